"""`mlx-fastops serve`: mlx-lm's own OpenAI-compatible server (`mlx_lm.server`: its flags, endpoints,
batching and prompt cache) on patched models.

Nothing of the server is re-implemented: `mlx_lm.server.main` runs on the rest of the command line.
The one seam is its `ModelProvider`, whose `_load` is extended so that every model the server loads
(the --model one when it starts, any other that a request names) is patched before a request runs
on it, and its patch report goes to stderr, then (warm_up) it decodes once at every batch size the
server can reach and prefills once at every prompt chunk length with kernels of its own. Draft
models (--draft-model) stay stock.
"""

import _thread
import contextlib
import io
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

PROG = "mlx-fastops serve"


class _Parsed(Exception):
    """Carries the Namespace out of mlx_lm.server.main when only its parser is wanted."""


class _Bare:
    """Stands in for ModelProvider while only the flags are parsed (the real one loads MLX state)."""

    def __init__(self, cli_args):
        self.cli_args = cli_args


def server_args(argv):
    """mlx_lm.server's own parser on `argv` (its flags, without --model): the Namespace. A bad flag
    raises ValueError with argparse's one-line message instead of its usage block."""
    from mlx_lm import server

    def parsed(host, port, provider, *_, **__):
        raise _Parsed(provider.cli_args)

    err = io.StringIO()
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        with _swapped(server, run=parsed, ModelProvider=_Bare), _argv(argv), contextlib.redirect_stderr(err):
            server.main()
    except _Parsed as e:
        return e.args[0]
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines() or [f"exit status {e.code}"]
        raise ValueError(lines[-1].removeprefix(f"{PROG}: error: ")) from None
    finally:
        # main's logging.basicConfig wrote its handler to the swapped stderr; the real run sets its own
        logging.root.handlers[:], logging.root.level = handlers, level
    raise AssertionError("mlx_lm.server.main returned without starting its server")


def port_problem(host, port):
    """Why the server could not listen on (host, port), or None (a bind tried now, as the server's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host!r}: {e}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as http.server's HTTPServer
        try:
            s.bind(address)
        except OSError as e:
            return f"cannot listen on {host} port {port}: {e.strerror or e}"
    return None


WARM_UP_PROMPT_ROWS = 64   # prompt chunks of up to this many rows have their own kernels (CUDA's qmm)
WARM_UP_FEW_ROWS = 8       # ... and batches of up to this many rows, by their shape (the one-launch layer's)


def warm_up_prompts():
    """The prompt batches of warm_up, as token-id lists: one prompt of n + 1 ids for every chunk of
    n = 2..WARM_UP_PROMPT_ROWS rows (BatchGenerator keeps a prompt's last token for the first decode
    step), then b >= 2 prompts of n + 1 ids for every b x n <= WARM_UP_FEW_ROWS, n >= 2: of equal
    length, and with the first one id shorter (a padded chunk, which takes other kernels)."""
    ids = lambda n: ([1, 2] * n)[:n]   # valid in any vocabulary
    batches = [[ids(n + 1)] for n in range(2, WARM_UP_PROMPT_ROWS + 1)]
    for b in range(2, WARM_UP_FEW_ROWS // 2 + 1):
        for n in range(2, WARM_UP_FEW_ROWS // b + 1):
            batches += [[ids(n + 1)] * b, [ids(n)] + [ids(n + 1)] * (b - 1)]
    return batches


def warm_up(model, rows):
    """Run `model` through mlx-lm's BatchGenerator, as the server does: a decode step at every batch
    size 1..rows (b prompts of 2 ids, 2 tokens each), then the prompt batches of warm_up_prompts (1
    token each); returns (seconds per batch size, index 0: 1 row; seconds of all the prompts).

    Why: our CUDA kernels are built by NVRTC (seconds each) on the first use of each shape class in
    each process, and a server meets its decode row counts and prompt shapes one after another as
    requests come and go, so without this it builds them mid-service and stalls every request in
    flight."""
    from mlx_lm.generate import BatchGenerator

    def run(prompts, max_tokens):
        gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                             prefill_batch_size=len(prompts))
        try:
            gen.insert(prompts)
            while gen.next_generated():
                pass
        finally:
            gen.close()

    decode = []
    for b in range(1, rows + 1):
        t0 = time.perf_counter()
        run([[1, 2]] * b, 2)
        decode.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for prompts in warm_up_prompts():
        run(prompts, 1)
    return decode, time.perf_counter() - t0


def warm_up_summary(decode, prompts):
    """'decode of 1-N rows in T s' with the three longest batch sizes (where the builds went), then
    the prompts' seconds."""
    longest = sorted(range(len(decode)), key=lambda i: -decode[i])[:3]
    parts = ", ".join(f"{i + 1} rows {decode[i]:.1f} s" for i in longest)
    return (f"decode of 1-{len(decode)} rows in {sum(decode):.1f} s (longest: {parts}); "
            f"prompts of 2-{WARM_UP_PROMPT_ROWS} rows in {prompts:.1f} s")


def rows_to_warm_up(requested, backend, cli_args):
    """The decode row counts to warm up: `requested` (--warm-up-rows) if given; else on the CUDA
    backend all that the server's BatchGenerator takes, on the others none (they build kernels fast)."""
    if requested is not None:
        return requested
    if backend != "cuda":
        return 0
    # the server's BatchGenerator decodes up to the larger of the two (its completion_batch_size)
    return max(cli_args.decode_concurrency, cli_args.prompt_concurrency)


def patching_provider(disable, failed, warm_up_rows=None):
    """A subclass of mlx_lm.server.ModelProvider whose loaded models are patched (disable: fusion
    names left stock, as patch() takes them), then warmed up (warm_up_rows: --warm-up-rows, None
    for the backend's default). If the --model one cannot load or be patched, it sets the
    threading.Event `failed` and interrupts the main thread, which stops the server (mlx_lm's
    generation thread dies then, and requests would wait for it for ever)."""
    from mlx_lm import server
    from mlx_lm.models.cache import make_prompt_cache

    from . import patch

    class PatchingModelProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            try:
                report = patch(self.model, disable=disable)
                # The server judged batching on the stock model's caches; the patched model's may differ.
                self.is_batchable = self.is_batchable and all(hasattr(c, "merge")
                                                              for c in make_prompt_cache(self.model))
                print(f"[serve] {model_path}: patched\n{report}", file=sys.stderr, flush=True)
                self._warm_up(rows_to_warm_up(warm_up_rows, report.backend, self.cli_args))
            except BaseException:
                self.reset()   # else the server would keep serving this model under this key, unpatched or cold
                raise

        def _warm_up(self, rows):
            if not rows:
                return
            # served one request at a time (as mlx_lm.server decides: also with --kv-bits): no
            # BatchGenerator runs it
            if not self.is_batchable or self.cli_args.kv_bits is not None:
                print("[serve] warm-up: skipped, the model is served one request at a time",
                      file=sys.stderr, flush=True)
                return
            try:
                decode, prompts = warm_up(self.model, rows)
            except Exception as e:
                raise RuntimeError(f"the warm-up failed ({type(e).__name__}: {e}); --warm-up-rows 0 "
                                   "skips it") from e
            print(f"[serve] warm-up: {warm_up_summary(decode, prompts)}", file=sys.stderr, flush=True)

        def load_default(self):
            try:
                super().load_default()
            except BaseException:
                failed.set()
                _thread.interrupt_main()
                raise

    return PatchingModelProvider


def serve(source, server_argv, disable="", bits=4, group_size=64, dtype=None, warm_up_rows=None):
    """Run mlx_lm.server on models.Source `source` (a synthetic one is written to a temporary
    directory first: bits, group_size and dtype shape it; warm_up_rows: as patching_provider's)
    with `server_argv` (its other flags) until SIGINT or SIGTERM, then end the process: status 0
    after a clean shutdown."""
    from mlx_lm import server

    # mlx_lm.server shuts down cleanly on KeyboardInterrupt (closes the HTTP server, stops and joins
    # its generation thread); SIGTERM takes the same way.
    signal.signal(signal.SIGTERM, _interrupt)
    folder, status, failed = None, 0, threading.Event()
    try:
        folder = synthetic_dir(source.spec, bits, group_size, dtype) if source.synthetic else None
        with _swapped(server, ModelProvider=patching_provider(disable, failed, warm_up_rows)), \
                _argv(["--model", folder or source.spec, *server_argv]):
            server.main()
    except KeyboardInterrupt:   # before the server ran, or a second one while it stopped
        status = 130
    except Exception as e:
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        status = 1
    finally:
        _remove(folder)
    if failed.is_set():   # the error is in mlx_lm.server's log above
        print(f"{PROG}: error: the model could not be loaded, patched and warmed up (see above); server stopped", file=sys.stderr)
        status = 1
    # Not a normal interpreter exit: MLX aborts in it ("terminate called without an active
    # exception", mlx 0.32 on its CPU backend, stock mlx_lm.server too) once it ran in a thread
    # other than the main one, as the server's generation thread; and after an error before the
    # server ran, that thread (not a daemon) would keep the process alive.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def synthetic_dir(name, bits=4, group_size=64, dtype=None):
    """A new temporary model directory holding synthetic model `name` (save_synthetic; dtype: a
    models.DTYPES name or None)."""
    from .models import DTYPES
    from .synthetic import save_synthetic

    path = tempfile.mkdtemp(prefix=f"mlx-fastops-serve-{name}-")
    try:
        save_synthetic(name, path, bits=bits, group_size=group_size, dtype=DTYPES[dtype] if dtype else None)
    except BaseException:
        _remove(path)
        raise
    return path


def _remove(folder):
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _swapped(module, **names):
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


@contextlib.contextmanager
def _argv(args):
    old = sys.argv
    sys.argv = [PROG, *args]
    try:
        yield
    finally:
        sys.argv = old
