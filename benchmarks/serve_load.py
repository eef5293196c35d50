"""Load test over HTTP: stock `mlx_lm.server` vs `mlx-fastops serve`, N concurrent streaming clients.

    python benchmarks/serve_load.py [--model M] [--clients 1,4,16] [--requests-per-client 4]
        [--max-tokens 128] [--prompt-words 64] [--time-limit 300] [--url LABEL=URL ...]
        [--out benchmarks/results/serve_load]

Without --url it starts each server itself, one after the other, on a free loopback port, on the
same model (a synthetic name is written once to a temporary directory that both load), and stops
it with SIGINT; with --url LABEL=URL (repeatable) it measures servers already running there and
starts none. Only loopback addresses are taken. Once a server has answered a first completion (its
model loaded), per concurrency C: one untimed warm-up round (C requests at once), then C clients,
each sending streaming /v1/completions requests (greedy, distinct prompts, so the prompt cache does
not serve them) one after another, until C x --requests-per-client were sent or --time-limit passed.

Per row: aggregate tok/s (completion tokens of every request / time from the first request sent to
the last answer), time to first token (request sent -> first streamed text) and per-token latency
(the gaps between streamed chunks; mlx_lm.server streams one chunk per token whose text is
complete) at p50/p99, and patched/stock tok/s. stdlib only (http.client and threads). Writes
OUT.md and OUT.json (machine block: mlx_fastops.bench.machine()).
"""

import argparse
import http.client
import ipaddress
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_CLIENTS = 64   # and at most 64 requests each per row
COMMANDS = {   # label -> command line before --model/--host/--port
    "stock": [sys.executable, "-m", "mlx_lm", "server"],
    "patched": [sys.executable, "-m", "mlx_fastops", "serve"],
}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def loopback(url):
    """(host, port) of an http:// URL whose host resolves to loopback addresses only; else ValueError."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://HOST:PORT")
    port = parts.port or 80
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise ValueError(f"{url!r}: {e}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"{url!r}: not a loopback address ({', '.join(sorted(addresses))}); this load "
                         "generator only drives servers on this machine")
    return parts.hostname, port


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i, words):
    """Request i's prompt, unlike any other request's (its number comes first)."""
    return " ".join([f"request {i}:"] + [WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(words)])


def stream(host, port, body, timeout):
    """One streaming completion: the times (perf_counter) of sending, of each chunk with text and of
    the end, and the usage the server reports."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(300)!r}")
        chunks, usage = [], None
        for line in resp:
            if not line.startswith(b"data: "):
                continue   # blank separators and ": keepalive" comments
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0].get("text"):
                chunks.append(time.perf_counter())
        if usage is None or not chunks:
            raise RuntimeError(f"stream ended without {'usage' if chunks else 'text'}")
        return {"sent": sent, "chunks": chunks, "end": time.perf_counter(), "usage": usage}
    finally:
        conn.close()


def run_load(host, port, clients, requests, max_tokens, words, time_limit, timeout, numbers):
    """`clients` threads sending streaming requests one after another until `requests` were sent or
    `time_limit` seconds passed: the finished requests and the errors. Request prompts are numbered
    by `numbers` (an iterator shared by every run on a server, so no prompt repeats)."""
    lock, done, errors, sent = threading.Lock(), [], [], [0]
    deadline = time.perf_counter() + time_limit

    def client():
        while True:
            with lock:
                if sent[0] >= requests or time.perf_counter() > deadline:
                    return
                sent[0] += 1
                i = next(numbers)
            body = {"prompt": prompt(i, words), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                result = stream(host, port, body, timeout)
            except Exception as e:   # counted and reported, the run goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                done.append(result)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    end = deadline + timeout   # requests still in flight then are left behind, and reported
    for t in threads:
        t.join(max(0.0, end - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        errors.append("clients still running past the time limit (left behind)")
    return done, errors


def percentile(xs, q):
    """Nearest-rank percentile (q in 0-100) of a non-empty list."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def summarise(label, clients, done, errors):
    row = {"server": label, "clients": clients, "requests": len(done), "errors": len(errors),
           "error_samples": errors[:3]}
    if not done:
        return row
    tokens = sum(r["usage"]["completion_tokens"] for r in done)
    wall = max(r["end"] for r in done) - min(r["sent"] for r in done)
    ttft = [r["chunks"][0] - r["sent"] for r in done]
    gaps = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    row.update(prompt_tokens=sum(r["usage"]["prompt_tokens"] for r in done) / len(done),
               completion_tokens=tokens, wall_s=wall, tok_s=tokens / wall,
               ttft_ms={"p50": 1e3 * percentile(ttft, 50), "p99": 1e3 * percentile(ttft, 99)})
    if gaps:
        row["token_ms"] = {"p50": 1e3 * percentile(gaps, 50), "p99": 1e3 * percentile(gaps, 99)}
    return row


def ready(host, port, timeout, alive=lambda: True):
    """Wait until the server answers /health, then one completion (it loads its model meanwhile),
    at most `timeout` seconds in all; RuntimeError if it does not."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise RuntimeError("exited before it answered")
        conn = http.client.HTTPConnection(host, port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                break
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer to /health within {timeout} s")
        time.sleep(0.25)
    conn = http.client.HTTPConnection(host, port, timeout=max(1.0, deadline - time.monotonic()))
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "ready?", "max_tokens": 1}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"its first completion answered HTTP {resp.status}: {resp.read(300)!r}")
        resp.read()
    except OSError as e:
        raise RuntimeError(f"no first completion within {timeout} s ({type(e).__name__}: {e})") from None
    finally:
        conn.close()


def sigint_default():
    """In a server process before it starts: SIGINT's default action. A shell without job control
    starts background commands with SIGINT ignored (POSIX), and children inherit that: a server
    started from such a run would outlive stop()'s SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Server:
    """A server process started on a free loopback port, its stderr in a log file; startup_s: the
    seconds until it answered /health and a first completion; stop() sends SIGINT (both servers shut
    down on it) and returns the exit status."""

    def __init__(self, label, model, extra, log_dir, startup_timeout):
        self.port = free_port()
        self.log = Path(log_dir) / f"{label}.log"
        cmd = [*COMMANDS[label], "--model", model, "--host", "127.0.0.1", "--port", str(self.port), *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=sigint_default)
        try:
            ready("127.0.0.1", self.port, startup_timeout, alive=lambda: self.proc.poll() is None)
            self.startup_s = time.monotonic() - t0
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{label} server: {e}; exit status {self.proc.returncode}; the end of its log:\n"
                               + self.log.read_text(errors="replace")[-2000:]) from None

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


def measure(label, host, port, a):
    rows, numbers = [], itertools.count()
    for c in a.clients:
        # warm-up: this many rows in one batch seen once
        _, warm = run_load(host, port, c, c, min(8, a.max_tokens), a.prompt_words, a.time_limit, a.timeout, numbers)
        done, errors = run_load(host, port, c, c * a.requests_per_client, a.max_tokens, a.prompt_words,
                                a.time_limit, a.timeout, numbers)
        rows.append(summarise(label, c, done, [f"warm-up: {e}" for e in warm] + errors))
        print(f"[serve_load] {label}, {c} clients: {rows[-1].get('tok_s', 0):.1f} tok/s, "
              f"{len(done)} requests, {len(errors)} errors", file=sys.stderr, flush=True)
    return rows


def ratios(rows):
    stock = {r["clients"]: r.get("tok_s") for r in rows if r["server"] == "stock"}
    for r in rows:
        if r["server"] != "stock" and stock.get(r["clients"]) and r.get("tok_s"):
            r["ratio"] = r["tok_s"] / stock[r["clients"]]


def markdown(doc):
    m, s = doc["machine"], doc["settings"]
    lines = ["# serve_load: stock mlx_lm.server vs mlx-fastops serve", "",
             f"{m['device']} ({m.get('gpu') or m['platform']}), mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, "
             f"commit {m['commit']}, sources {m['sources']}, {m['date']}", "",
             f"model {s['model']}; streaming /v1/completions, greedy, {s['max_tokens']} tokens max, prompts of "
             f"{s['prompt_words']} words; {s['requests_per_client']} requests per client after a warm-up round; "
             f"time limit {s['time_limit']} s per row"
             + "".join(f"; {k}={m[k]}" for k in ("MLX_FASTOPS_TUNE", "MLX_FASTOPS_DISABLE") if m.get(k)), "",
             "| server | clients | requests | errors | prompt tokens | tokens | tok/s | ratio | TTFT p50 ms | "
             "TTFT p99 ms | per-token p50 ms | per-token p99 ms |", "|" + "---|" * 12]
    for r in doc["rows"]:
        if "tok_s" not in r:
            lines.append(f"| {r['server']} | {r['clients']} | 0 | {r['errors']} |" + " - |" * 8)
            continue
        tok = r.get("token_ms", {"p50": float("nan"), "p99": float("nan")})
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(f"| {r['server']} | {r['clients']} | {r['requests']} | {r['errors']} | {r['prompt_tokens']:.0f} "
                     f"| {r['completion_tokens']} | {r['tok_s']:.1f} | {ratio} | {r['ttft_ms']['p50']:.1f} | "
                     f"{r['ttft_ms']['p99']:.1f} | {tok['p50']:.2f} | {tok['p99']:.2f} |")
    errors = [f"- {r['server']}, {r['clients']} clients: {e}" for r in doc["rows"] for e in r["error_samples"]]
    if errors:
        lines += ["", "Errors (first of each row):", *errors]
    if doc.get("startup_s"):
        lines += ["", "Seconds from start to a first completion: "
                  + ", ".join(f"{k} {v}" for k, v in doc["startup_s"].items())
                  + (f"; the patched server's {doc['warm_up'][len('[serve] '):]}" if doc.get("warm_up") else "")]
    if doc["patch_report"]:
        lines += ["", "The patched server's patch report:", "", doc["patch_report"]]
    if doc["exit_status"]:
        lines += ["", "Server exit status after SIGINT: "
                  + ", ".join(f"{k} {v}" for k, v in doc["exit_status"].items())]
    return "\n".join(lines) + "\n"


def warm_up_line(log):
    """The warm-up line that `mlx-fastops serve` printed in its log, or None."""
    return next((line for line in log.splitlines() if line.startswith("[serve] warm-up")), None)


def patch_report(log):
    """The patch report table that `mlx-fastops serve` printed in its log, or None."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("mlx_fastops patch:")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def labelled_url(text):
    label, sep, url = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"expected LABEL=URL, got {text!r}")
    try:
        return label, loopback(url)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bounded_list(text):
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or not all(1 <= v <= MAX_CLIENTS for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated client counts from 1 to {MAX_CLIENTS}")
    return values


def positive(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="synthetic name, model directory or Hugging Face repo for both "
                                                  "servers (default: mlx-fastops' default for this machine)")
    ap.add_argument("--bits", type=int, choices=[0, 2, 3, 4, 5, 6, 8], default=4,
                    help="synthetic models: quantisation bits, 0 for float (default: 4)")
    ap.add_argument("--clients", type=bounded_list, default=[1, 4, 16], help="concurrency levels (default: 1,4,16)")
    ap.add_argument("--requests-per-client", type=int, choices=range(1, 65), default=4, metavar="1-64",
                    help="timed requests per client and concurrency level (default: 4)")
    ap.add_argument("--max-tokens", type=int, choices=range(1, 4097), default=128, metavar="1-4096",
                    help="tokens per request (default: 128)")
    ap.add_argument("--prompt-words", type=int, choices=range(0, 8193), default=64, metavar="0-8192",
                    help="words per prompt after the request's number (default: 64)")
    ap.add_argument("--time-limit", type=positive, default=300.0,
                    help="seconds per row after which no request is sent (default: 300)")
    ap.add_argument("--timeout", type=positive, default=120.0,
                    help="seconds a request may wait for each read (default: 120)")
    ap.add_argument("--startup-timeout", type=positive, default=600.0,
                    help="seconds a server may take to answer /health and then a first completion "
                         "(default: 600)")
    ap.add_argument("--server-args", default="", help="more flags for both started servers, one string "
                                                      "(default: none)")
    ap.add_argument("--url", type=labelled_url, action="append", default=[], metavar="LABEL=URL",
                    help="measure the server running at URL (loopback only) under LABEL; repeatable; then no "
                         "server is started (default: start stock and patched)")
    ap.add_argument("--out", default="benchmarks/results/serve_load", help="writes OUT.md and OUT.json")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    out = Path(a.out)
    if not out.parent.is_dir():
        parser().error(f"--out: folder {out.parent} does not exist")
    from mlx_fastops import models
    from mlx_fastops.bench import machine

    rows, exit_status, startup_s, model, report, warm_up = [], {}, {}, a.model, None, None
    if a.url:
        for label, (host, port) in a.url:
            ready(host, port, a.startup_timeout)
            rows += measure(label, host, port, a)
    else:
        source = models.resolve(a.model)
        model = source.spec
        with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
            folder = source.spec
            if source.synthetic:
                from mlx_fastops.synthetic import save_synthetic

                folder = str(save_synthetic(source.spec, Path(tmp) / "model", bits=a.bits or None))
            for label in COMMANDS:
                server = Server(label, folder, a.server_args.split(), tmp, a.startup_timeout)
                startup_s[label] = round(server.startup_s, 1)
                try:
                    rows += measure(label, "127.0.0.1", server.port, a)
                finally:
                    exit_status[label] = server.stop()
                    if label == "patched":
                        log = server.log.read_text()
                        report, warm_up = patch_report(log), warm_up_line(log)
    ratios(rows)
    settings = {k: getattr(a, k) for k in ("clients", "requests_per_client", "max_tokens", "prompt_words",
                                           "time_limit", "server_args")}
    doc = {"machine": machine(), "settings": {"model": model, "urls": {k: f"http://{h}:{p}" for k, (h, p) in a.url},
                                              **settings},
           "rows": rows, "exit_status": exit_status, "startup_s": startup_s, "warm_up": warm_up,
           "patch_report": report}
    Path(f"{out}.json").write_text(json.dumps(doc, indent=1))
    Path(f"{out}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 1 if any(r["errors"] or not r["requests"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
