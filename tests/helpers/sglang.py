"""Helpers for the SGLang tests: import the real `sglang` package on a CPU-only box, build real `ForwardBatch`es, and an
emulated SGLang HTTP server (run as `python -m helpers.sglang serve ...` with tests/ on the path) for the driver test.

Why a shim at import: `sglang.srt.configs` imports `torchvision.transforms` (VLM configs) and registers image
processors with `transformers.AutoImageProcessor`. PyPI's torchvision wheels are CUDA builds: with this CPU torch their
C extension cannot load and `import torchvision` fails inside torchvision's own `_meta_registrations`. So when (and
only when) torchvision cannot be imported, `torchvision.*` is stubbed with SGLang's own `_platform_stubs._MockModule`
(the stub SGLang uses for triton on macOS; nothing here calls into it) and transformers' top-level
`AutoImageProcessor` is bound to the real class (transformers 5 replaces it by a torchvision dummy when torchvision is
missing). On a GPU box with the full `pip install sglang` the shim does nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path

import torch

LAYERS = [0, 2, 4]  # canonical ids the SGLang tests capture from the 6-layer tiny target; K = 3
H = 64  # its hidden size


def import_sglang():
    """Import the SGLang modules the tests use (with the shim above when torchvision is unusable); returns sglang."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a CUDA wheel that cannot load its C extension
        sys.modules.pop("torchvision", None)
        ipa = importlib.import_module("transformers.models.auto.image_processing_auto")
        sys.modules["transformers"].AutoImageProcessor = ipa.AutoImageProcessor
        from sglang._platform_stubs import _MockModule

        class _StubLoader(importlib.abc.Loader):
            def create_module(self, spec):
                return _MockModule(spec.name)

            def exec_module(self, module):
                pass

        class _StubFinder(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path=None, target=None):
                if fullname == "torchvision" or fullname.startswith("torchvision."):
                    return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
                return None

        sys.meta_path.insert(0, _StubFinder())
    import sglang
    import sglang.srt.layers.logits_processor  # noqa: F401
    import sglang.srt.model_executor.forward_batch_info  # noqa: F401
    import sglang.srt.model_executor.hook_manager  # noqa: F401
    return sglang


def records(n: int, seed: int = 0, hostile: bool = True) -> list[dict]:
    """Chat records (stdlib docs, answers cut to varied lengths); with `hostile`, the first ids are hostile strings."""
    import random

    from hstap.demo.toy import stdlib_conversations

    rng = random.Random(seed)
    convs = stdlib_conversations()
    rng.shuffle(convs)
    out = []
    bad = ["../x", "a" * 5000, "nul\x00id", "/etc/passwd", "sp ace\nnew"]
    for k, c in enumerate(convs[:n]):
        user, asst = c["conversations"]
        sid = bad[k] if hostile and k < len(bad) else c["id"]
        answer = {"role": "assistant", "content": asst["content"][:rng.randint(20, 200)]}
        out.append({"id": sid, "conversations": [user, answer]})
    return out


def create_store(target: Path, data: Path, out: Path, layers: list[int], dtype: str = "fp32") -> dict:
    """What the driver does before it sends requests: create the store with the target's header."""
    from hstap.capture.inputs import store_header
    from hstap.data.prepare import read_meta
    from hstap.artifacts.model_dir import target_fingerprint
    from hstap.store.writer import StoreWriter

    tb = target_fingerprint(target)
    header = store_header(tb, {"name": "sglang", "version": "test", "device": "cpu", "compute_dtype": "fp32"}, dtype,
                          layers, {"test": True}, read_meta(data))
    StoreWriter(out, header, new=True).close()
    return header


def publish_server_args(model_dir: Path, argv: list[str] = ()):
    """A resolved real ServerArgs, published as SGLang's scheduler does (LogitsProcessor reads it)."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu", *argv])
    sa.resolve_once()
    publish(sa, role="test")
    return sa


def logits_root(hf_config) -> torch.nn.Module:
    """A model stand-in whose only child is SGLang's real LogitsProcessor, named `logits_processor` as in every
    SGLang model, so `register_forward_hooks` finds it by the same name pattern as in a server."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    root = torch.nn.Module()
    root.logits_processor = LogitsProcessor(hf_config)
    root.lm_head = torch.nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
    return root


def forward_batch(mode: str, rids: list, ext: list[int] | None, pre: list[int] | None, input_ids: torch.Tensor,
                  batch_size: int | None = None, **extra):
    """A real `ForwardBatch` as `ForwardBatch.init_new` fills it for a CPU batch (the fields the hook and the
    LogitsProcessor read)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    bs = len(rids) if batch_size is None else batch_size
    kw: dict = {}
    if ext is not None:
        seq = [p + e for p, e in zip(pre, ext)]
        start = [0]
        for e in ext[:-1]:
            start.append(start[-1] + e)
        kw = dict(extend_seq_lens=torch.tensor(ext, dtype=torch.int32), extend_prefix_lens=torch.tensor(pre),
                  extend_start_loc=torch.tensor(start, dtype=torch.int32), extend_seq_lens_cpu=list(ext),
                  extend_prefix_lens_cpu=list(pre), extend_num_tokens=sum(ext), extend_logprob_start_lens_cpu=list(ext),
                  positions=torch.cat([torch.arange(p, p + e) for p, e in zip(pre, ext)]) if ext else torch.zeros(0))
    else:
        seq = extra.pop("seq_lens", [1] * bs)
    kw.update(extra)
    return ForwardBatch(forward_mode=ForwardMode[mode], batch_size=bs, input_ids=input_ids,
                        req_pool_indices=torch.arange(bs), seq_lens=torch.tensor(seq, dtype=torch.int64),
                        out_cache_loc=torch.arange(int(input_ids.shape[0])), seq_lens_sum=int(sum(seq)),
                        seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
                        orig_seq_lens=torch.tensor(seq, dtype=torch.int32), rids=list(rids),
                        capture_hidden_mode=CaptureHiddenMode.NULL, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# The emulated server (a real process, a real HTTP server on 127.0.0.1)


def serve(argv: list[str]) -> None:
    """`serve PORT_FILE TARGET_DIR -- <sglang launch_server args>`: an HTTP server with SGLang's /server_info,
    /get_server_info and /generate, whose "model" is the HF target (hstap.models.target.Target) and whose scheduler packs
    prefill-only requests into chunked EXTEND batches of `--chunked-prefill-size` tokens, builds real ForwardBatches and
    calls SGLang's real LogitsProcessor, to which `register_forward_hooks` attached the `--forward-hooks` specs."""
    import http.server
    import queue
    import threading

    port_file, target_dir = Path(argv[0]), Path(argv[1])
    sg_argv = argv[argv.index("--") + 1:]
    sglang = import_sglang()
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from sglang.srt.utils.common import build_server_info
    from transformers import AutoConfig

    from hstap.artifacts.model_dir import load_target

    torch.set_num_threads(1)
    sa = publish_server_args(target_dir, sg_argv)
    info = dict(build_server_info(sa, {}), version=sglang.__version__)
    info = json.loads(json.dumps(info, default=str))
    hf_cfg = AutoConfig.from_pretrained(str(target_dir))
    root = logits_root(hf_cfg)
    if sa.forward_hooks:
        register_forward_hooks(root, sa.forward_hooks)
    layers = []
    for h in sa.forward_hooks or []:
        layers = (h.get("config") or {}).get("layers", layers)
    target, _ = load_target(target_dir, "cpu", "fp32")
    chunk = int(info.get("chunked_prefill_size") or 64)
    radix_on = not info.get("disable_radix_cache")
    seen: dict = {}  # (extra_key, tokens) -> cached: the radix cache, by namespace
    inbox: queue.Queue = queue.Queue()
    model_lock = threading.Lock()

    def scheduler():
        running: list[dict] = []
        while True:
            while not running or not inbox.empty():
                running.append(inbox.get())
            batch, budget = [], chunk
            for r in running:  # FCFS; the last request admitted may be cut (chunked prefill)
                if budget <= 0:
                    break
                n = min(budget, r["T"] - r["done"])
                batch.append((r, r["done"], n))
                budget -= n
            ids = torch.cat([r["ids"][p:p + n] for r, p, n in batch])  # (R,)
            aux = torch.cat([r["aux"][p:p + n] for r, p, n in batch])  # (R, K*H)
            fin = torch.cat([r["final"][p:p + n] for r, p, n in batch])  # (R, H)
            fb = forward_batch("EXTEND", [r["rid"] for r, _, _ in batch], [n for _, _, n in batch],
                               [p for _, p, _ in batch], ids)
            root.logits_processor(ids, fin, root.lm_head, fb, aux)
            for r, p, n in batch:
                r["done"] = p + n
                if r["done"] >= r["T"]:
                    running.remove(r)
                    r["event"].set()

    threading.Thread(target=scheduler, daemon=True).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, obj: dict):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/server_info", "/get_server_info"):
                return self._send(200, info)
            self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/generate":
                return self._send(404, {"error": "not found"})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("sampling_params", {}).get("max_new_tokens") != 0:
                return self._send(400, {"error": "this emulator serves prefill-only requests"})
            tokens = [int(x) for x in req["input_ids"]]
            ids = torch.tensor(tokens)
            with model_lock, torch.no_grad():  # Target.capture hooks the layers: one forward at a time
                a, f, _ = target.capture(ids[None], layers)  # (1, T, K, H), (1, T, H)
            T = len(tokens)
            prefix = 0
            if radix_on:  # radix cache: reuse the longest cached prefix in this namespace (at most T-1 tokens)
                for (ns, prev) in seen:
                    if ns == req.get("extra_key"):
                        m = 0
                        while m < min(len(prev), T - 1) and prev[m] == tokens[m]:
                            m += 1
                        prefix = max(prefix, m)
                seen[(req.get("extra_key"), tuple(tokens))] = True
            r = {"rid": req.get("rid") or "anon", "ids": ids, "aux": a[0].reshape(T, -1), "final": f[0], "T": T,
                 "done": prefix, "event": threading.Event()}
            inbox.put(r)
            r["event"].wait()
            self._send(200, {"text": "", "meta_info": {"id": r["rid"], "prompt_tokens": T, "completion_tokens": 0,
                                                       "cached_tokens": prefix}})

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(httpd.server_address[1]))
    tmp.rename(port_file)
    httpd.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2:])
