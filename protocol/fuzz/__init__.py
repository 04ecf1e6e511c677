"""A fuzz and conformance kit for the wire protocol of PROTOCOL.md.

Run it against any server that speaks the protocol (``python -m protocol.fuzz
HOST:PORT --token-file T``, or ``harnessd fuzz``): the numbered case catalogue
(:mod:`protocol.fuzz.cases`), then open-ended fuzzing (:mod:`protocol.fuzz.explore`),
with a verdict per case, reports, and a replayable repro file per failure.
``docs/fuzzing.md`` is the user's guide.

Building blocks for your own tests:

* :mod:`protocol.fuzz.strategies` -- hypothesis strategies for every layer
  (frames, each message type, handshakes, RPC params per method, byte mutations);
* :mod:`protocol.fuzz.machine` -- a rule-based state machine of one
  connection, run against the sans-I/O server in this process
  (:mod:`protocol.fuzz.loopback`) or a live server (:mod:`protocol.fuzz.live`);
* :mod:`protocol.fuzz.script` -- scripts (JSON) of what goes over the wire and
  what must come back, run by :mod:`protocol.fuzz.interpreter`;
* ``protocol.fuzz.coverage`` -- coverage-guided fuzzing of the decoders with atheris;
* :mod:`protocol.fuzz.export` -- section 16's vectors and the catalogue as JSON.

The strategies, the machine and the fuzzing need the ``fuzz`` extra
(hypothesis), the coverage-guided mode the ``atheris`` extra. Importing
:mod:`protocol` or this package imports neither. Only :mod:`protocol.fuzz.live`
opens sockets or starts processes.
"""
