"""What streams already running on an engine add to a new request's time to first token.

`kv`'s cost charges an instance for the streams running there (route/src/kv/cost.rs,
`decode_ms`); this measures what they cost on a real engine and on engine-sim. For each
prompt size it sends `--samples` streamed requests with fresh (never cached) prompts and
`max_tokens` 1, one at a time, first with the engine idle, then with 1 and with 3 streams
decoding beside them (each a short prompt generating `--background-tokens` tokens, restarted
as it ends). Prints a Markdown table: the prompt's tokens (the engine's count) and the TTFT
median and minimum per number of running streams. Standard library only.

    python3 benches/running_streams.py --url http://127.0.0.1:8000 --model qwen3
"""

import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def prompt(words, rng):
    """`words` random words with numbers: no two prompts share a cached block."""
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(words))


def stream(url, model, text, max_tokens, timeout):
    """Sends one streamed chat completion; returns (TTFT in ms, prompt tokens)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    start = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        first = None
        prompt_tokens = None
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            # The first event with a choice comes with the first token (vLLM's carries the
            # role; a random-weight model's first token may decode to no text).
            if first is None and event.get("choices"):
                first = (time.monotonic() - start) * 1000.0
            usage = event.get("usage")
            if usage:
                prompt_tokens = usage.get("prompt_tokens")
        if first is None:
            raise RuntimeError("the stream carried no choice")
        return first, prompt_tokens
    finally:
        conn.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--words", default="100,300", help="prompt sizes, in words")
    parser.add_argument("--running", default="0,1,3", help="streams decoding beside")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--background-tokens", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print("| prompt tokens | running streams | TTFT median (ms) | TTFT min (ms) |")
    print("|---:|---:|---:|---:|")
    for words in (int(w) for w in args.words.split(",")):
        for running in (int(r) for r in args.running.split(",")):
            stop = threading.Event()
            started = threading.Semaphore(0)
            failures = []

            def decoding(seed):
                try:
                    keep_decoding(seed)
                except Exception as error:  # reported below: the run is void without it
                    failures.append(error)
                    started.release()

            def keep_decoding(seed):
                # Signals when a stream of its own produces its first token; keeps one
                # stream decoding until told to stop.
                local = random.Random(seed)
                parts = urllib.parse.urlsplit(args.url)
                while not stop.is_set():
                    conn = http.client.HTTPConnection(parts.hostname, parts.port,
                                                      timeout=args.timeout)
                    body = json.dumps({
                        "model": args.model,
                        "messages": [{"role": "user", "content": prompt(5, local)}],
                        "max_tokens": args.background_tokens,
                        "ignore_eos": True,
                        "stream": True,
                    })
                    conn.request("POST", "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
                    signalled = False
                    for line in conn.getresponse():
                        if not signalled and b'"content"' in line:
                            started.release()
                            signalled = True
                        if stop.is_set():
                            break
                    conn.close()

            threads = [threading.Thread(target=decoding, args=(rng.random(),), daemon=True)
                       for _ in range(running)]
            for thread in threads:
                thread.start()
            for _ in range(running):
                if not started.acquire(timeout=args.timeout):
                    raise SystemExit("a background stream produced no token in time")
            results = [stream(args.url, args.model, prompt(words, rng), 1, args.timeout)
                       for _ in range(args.samples)]
            stop.set()
            for thread in threads:
                thread.join(timeout=args.timeout)
            if failures:
                raise SystemExit(f"a background stream failed: {failures[0]}")
            ttfts = [ttft for ttft, _ in results]
            tokens = statistics.median(t for _, t in results if t is not None)
            print(f"| {tokens:.0f} | {running} | {statistics.median(ttfts):.1f} "
                  f"| {min(ttfts):.1f} |", flush=True)


if __name__ == "__main__":
    main()
