"""The FastAPI app of the HTTP/JSON baseline (imported only by the baseline's server process).

``POST /call`` takes ``{"method": ..., "params": ...}`` and answers
``{"result": None}``, or ``{"result": params}`` for the ``echo`` method.

No ``from __future__ import annotations`` here: FastAPI reads the handler's
annotations at run time to know that ``request`` is the Request.
"""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


@app.post("/call")
async def call(request: Request) -> JSONResponse:
    """Answer one call."""
    body = await request.json()
    result = body.get("params") if body.get("method") == "echo" else None
    return JSONResponse({"result": result})
