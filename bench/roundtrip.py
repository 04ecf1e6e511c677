"""Sections 1 and 2: no-op round trips and pipelined throughput, beside the floor and the alternatives.

1. One call in flight at a time: ``server.noop`` through execd (plaintext
   and AES-256-GCM, client on uvloop), the raw uvloop msgpack floor, FastAPI
   on uvicorn with an httpx keep-alive client, and grpcio unary. The five are
   measured in interleaved batches so the machine's noise hits them alike; the
   plaintext no-op once more without request ids (PROTOCOL.md 8.1), what
   carrying them costs. The client runs on one core and every server on
   another (:mod:`bench.placement`: left to the scheduler, placement decided
   the ratio); then the floor and execd once more with everything on one
   core, where what is left is each end's CPU time per round trip.
2. 64 calls in flight on one connection (64 tasks each awaiting one call at
   a time), calls per second, for execd and the floor (and gRPC, which
   multiplexes on one channel; HTTP/1.1 cannot pipeline on one connection).
   Server CPU per call is read from /proc around each run. Pinned as in 1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

from bench.baselines import GrpcClient, HttpClient, http_parser_name
from bench.env import Env, cpu_seconds
from bench.floor import connect_floor
from bench.placement import one_core_rows, pinned
from bench.report import Row, Target
from bench.servers import start_server
from bench.settings import HOST, IN_FLIGHT, Settings
from bench.stats import Call, interleaved, pipelined, rate_summary, summarize

NOOP = "1. No-op call round trip (one call in flight)"
PIPE = f"2. Pipelined throughput ({IN_FLIGHT} calls in flight on one connection)"

NOOP_TARGET = 1.3
NOOP_AES_TARGET = 1.5
PIPE_TARGET = 0.6


async def run(env: Env) -> list[Row]:
    """Both sections, sharing the connections and the baseline servers."""
    settings = env.settings
    async with start_server("http") as http_server, start_server("grpc") as grpc_server:
        floor = await connect_floor(HOST, env.raw.ports["rpc"])
        plain = await env.execd.connect()
        aes = await env.execd.connect(encrypt="aes-256-gcm")
        # The same calls without request ids (PROTOCOL.md 8.1): what carrying them costs.
        noid = await env.execd.connect()
        noid.request_ids = False
        http = HttpClient(HOST, http_server.ports["http"])
        grpc = GrpcClient(HOST, grpc_server.ports["grpc"])
        try:
            await grpc.ready()

            async def floor_noop() -> object:
                return await floor.call("noop")

            async def http_noop() -> object:
                return await http.call("noop")

            async def grpc_noop() -> object:
                return await grpc.call("noop")

            approaches: dict[str, Call] = {
                "floor": floor_noop,
                "execd": plain.noop,
                "execd_aes": aes.noop,
                "execd_noid": noid.noop,
                "http": http_noop,
                "grpc": grpc_noop,
            }
            fast, slow = settings.noop_samples, settings.noop_samples_slow
            counts = {
                "floor": fast,
                "execd": fast,
                "execd_aes": fast,
                "execd_noid": fast,
                "http": slow,
                "grpc": slow,
            }
            servers = {
                "floor": env.raw.pid,
                "execd": env.execd.pid,
                "execd_aes": env.execd.pid,
                "execd_noid": env.execd.pid,
                "grpc": grpc_server.pid,
            }
            everyone = {*servers.values(), http_server.pid}
            with pinned(everyone, "cross") as where:
                samples = await interleaved(approaches, counts, rounds=settings.noop_rounds)
                rows = _noop_rows(samples, where)
                pipe = {name: approaches[name] for name in servers}
                pipelined_rows = await _pipelined_rows(pipe, servers, settings)
            one_core = {name: approaches[name] for name in ("floor", "execd", "execd_aes")}
            with pinned(everyone, "same") as where:
                samples = await interleaved(
                    one_core, {name: counts[name] for name in one_core}, rounds=settings.noop_rounds
                )
            rows += _one_core_rows(samples, where)
            rows += pipelined_rows
        finally:
            floor.close()
            await plain.close()
            await aes.close()
            await noid.close()
            await http.close()
            await grpc.close()
    return rows


def _noop_rows(samples: dict[str, list[float]], where: str) -> list[Row]:
    shorts = {"floor": "floor", "http": "HTTP", "grpc": "gRPC", "execd": "execd plain"}

    def row(key: str, label: str, baselines: tuple[str, ...] = ("noop.floor",)) -> Row:
        summary = summarize(samples[key])
        return Row(
            key=f"noop.{key}",
            section=NOOP,
            label=label,
            short=shorts.get(key, ""),
            unit="us",
            **summary.figures(),
            baselines=baselines,
            extra={"mean": summary.mean},
        )

    floor = row("floor", f"raw uvloop msgpack floor ({where})", ())
    http = row("http", f"FastAPI on uvicorn ({http_parser_name()}), httpx keep-alive")
    grpc = row("grpc", "grpcio unary, generic handler, bytes")
    execd = row("execd", "execd server.noop, plaintext", ("noop.floor", "noop.http", "noop.grpc"))
    aes = row(
        "execd_aes",
        "execd server.noop, aes-256-gcm",
        ("noop.floor", "noop.execd", "noop.http", "noop.grpc"),
    )
    noid = row(
        "execd_noid", "execd server.noop, plaintext, no request id", ("noop.floor", "noop.execd")
    )
    execd.target = Target(f"p50 <= {NOOP_TARGET}x floor", execd.p50 / floor.p50, NOOP_TARGET)
    aes.target = Target(f"p50 <= {NOOP_AES_TARGET}x floor", aes.p50 / floor.p50, NOOP_AES_TARGET)
    return [floor, http, grpc, execd, aes, noid]


def _one_core_rows(samples: dict[str, list[float]], where: str) -> list[Row]:
    """The floor and execd again with everything on one core: CPU per round trip, no wake-ups."""
    labels = {
        "floor": f"raw uvloop msgpack floor ({where})",
        "execd": "execd server.noop, plaintext, on that core",
        "execd_aes": "execd server.noop, aes-256-gcm, on that core",
    }
    return one_core_rows(samples, labels, prefix="noop1.", section=NOOP, short="floor on one core")


async def _pipelined_rows(
    approaches: dict[str, Callable[[], Awaitable[object]]],
    servers: dict[str, int],
    settings: Settings,
) -> list[Row]:
    total, reps = settings.pipelined_calls, settings.pipelined_reps
    times: dict[str, list[float]] = {name: [] for name in approaches}
    cpu: dict[str, float] = dict.fromkeys(approaches, 0.0)
    client_cpu: dict[str, float] = dict.fromkeys(approaches, 0.0)
    for call in approaches.values():
        await pipelined(call, min(total, 500), IN_FLIGHT)
    for _ in range(reps):
        for name, call in approaches.items():
            server_before = cpu_seconds(servers[name])
            client_before = time.process_time()
            times[name].append(await pipelined(call, total, IN_FLIGHT))
            cpu[name] += cpu_seconds(servers[name]) - server_before
            client_cpu[name] += time.process_time() - client_before
    labels = {
        "floor": "raw uvloop msgpack floor, pipelined",
        "grpc": "grpcio unary, 64 concurrent on one channel",
        "execd": "execd server.noop, plaintext",
        "execd_aes": "execd server.noop, aes-256-gcm",
        "execd_noid": "execd server.noop, plaintext, no request id",
    }
    rows: list[Row] = []
    for name in approaches:
        summary = rate_summary(total, times[name])
        calls = total * reps
        rows.append(
            Row(
                key=f"pipe.{name}",
                section=PIPE,
                label=labels[name],
                short="floor" if name == "floor" else "",
                unit="calls/s",
                **summary.figures(),
                baselines=()
                if name == "floor"
                else ("pipe.floor", "pipe.execd")
                if name == "execd_noid"
                else ("pipe.floor",),
                extra={
                    "server_cpu_us_per_call": cpu[name] / calls * 1e6,
                    "client_cpu_us_per_call": client_cpu[name] / calls * 1e6,
                    "cores": float(os.cpu_count() or 1),
                },
            )
        )
    by_key = {row.key: row for row in rows}
    execd, floor = by_key["pipe.execd"], by_key["pipe.floor"]
    execd.target = Target(
        f"calls/s >= {PIPE_TARGET} of floor", execd.p50 / floor.p50, PIPE_TARGET, True
    )
    return rows
