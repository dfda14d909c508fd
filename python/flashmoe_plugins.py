#!/usr/bin/env python3
"""flashmoe plug-in host: a user's Python attention callable, benched by the lab.

``flashmoe bench attention --impl py:MODULE:FUNCTION`` starts this script (with the
``--python`` interpreter) and speaks the worker protocol to it (JSON lines, protocol 1, as
``flashmoe_worker.py``; see docs/plugins.md): the lab's inputs are generated here with the
same generator and checksummed, the callable's output goes through the same correctness
gate, and each ``sample`` is one timed call, interleaved with every other implementation.

The callable::

    def my_attention(q, k, v, *, causal, softmax_scale):
        # q: [B, Sq, Hq, D]; k, v: [B, Sk, Hkv, D] (Hq a multiple of Hkv: GQA)
        # numpy float32 arrays on --device cpu; torch tensors of the problem's dtype
        # on --device cuda.
        return o            # [B, Sq, Hq, D], or (o, lse) with lse [B, Hq, Sq] (natural log)

MODULE is an importable module name (on PYTHONPATH or the current directory) or a path to
a ``.py`` file. Attention problems only (MoE and decode problems answer n/a).

Timing: ``--device cpu`` (numpy only, no torch needed) uses the host clock around the call;
``--device cuda`` (torch) writes an L2-sized flush buffer, then times the call between CUDA
events, like the worker.
"""

import importlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback

PROTOCOL_VERSION = 1
PREFIX = "py:"


class NotApplicable(Exception):
    pass


def log(*args):
    print("[flashmoe-plugins]", *args, file=sys.stderr, flush=True)


def load_callable(spec):
    """'py:MODULE:FUNCTION' → the function. MODULE may be a module name or a .py path."""
    if not spec.startswith(PREFIX):
        raise NotApplicable(f"'{spec}' is not a plug-in (expected py:MODULE:FUNCTION)")
    module, sep, func = spec[len(PREFIX):].rpartition(":")
    if not sep or not module or not func:
        raise NotApplicable(f"'{spec}': expected py:MODULE:FUNCTION")
    if module.endswith(".py"):
        path = os.path.abspath(module)
        if not os.path.isfile(path):
            raise NotApplicable(f"'{spec}': no file {path}")
        name = "flashmoe_plugin_" + os.path.splitext(os.path.basename(path))[0]
        s = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        mod = importlib.import_module(module)
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise NotApplicable(f"'{spec}': {module} has no callable '{func}'")
    return fn


class Host:
    def __init__(self, device):
        import numpy as np
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import flashmoe_inputs as fi
        self.np, self.fi, self.device = np, fi, device
        self.torch = None
        self.flush = None
        self.flush_bytes = None
        if device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch has no CUDA device")
            torch.set_grad_enabled(False)
            self.torch = torch
        elif device != "cpu":
            raise RuntimeError(f"unknown device '{device}': expected cpu or cuda")
        self.handles = {}
        self.next_handle = 1
        self.callables = {}

    # ------------------------------------------------------------------ inputs
    def inputs(self, problem, seed):
        """q, k, v in the plug-in's layout and type, and the checksum flashmoe compares."""
        fi, np = self.fi, self.np
        dtype = problem["dtype"]
        if dtype not in fi.DTYPES:
            raise NotApplicable(f"unknown dtype '{dtype}'")
        out, parts = {}, []
        for name, tid, shape, scale in fi.problem_specs(problem):
            storage = fi.generate(seed, tid, int(np.prod(shape)), scale, dtype)
            parts.append(fi.checksum(storage, dtype))
            if self.torch is None:
                out[name] = fi.decode(storage, dtype).reshape(shape)
            else:
                t = self.torch
                if dtype == "bf16":
                    x = t.from_numpy(np.ascontiguousarray(storage).view(np.int16)).view(t.bfloat16)
                else:
                    x = t.from_numpy(np.ascontiguousarray(storage))
                out[name] = x.reshape(shape).to("cuda")
        return out, fi.fold_checksums(parts)

    # ------------------------------------------------------------------ ops
    def op_configure(self, req):
        if req.get("flush_bytes") is not None:
            self.flush_bytes = int(req["flush_bytes"])
            self.flush = None
        return {"flush_bytes": self.flush_bytes}

    def op_prepare(self, req):
        spec, problem, seed = req.get("impl", ""), req.get("problem"), int(req.get("seed", 0))
        if not isinstance(problem, dict):
            raise ValueError("prepare needs a 'problem' object")
        if problem.get("kind") != "attention":
            raise NotApplicable(f"plug-ins run attention problems, not {problem.get('kind')}")
        if spec not in self.callables:
            self.callables[spec] = load_callable(spec)
        fn = self.callables[spec]
        tensors, checksum = self.inputs(problem, seed)
        d = problem["head_dim"]
        scale = problem.get("softmax_scale")
        if scale is None:
            scale = float(self.np.float32(1.0) / self.np.sqrt(self.np.float32(d)))
        kwargs = {"causal": bool(problem["causal"]), "softmax_scale": float(scale)}
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = (lambda: fn(q, k, v, **kwargs), problem)
        return {"handle": h, "input_checksum": checksum, "outputs": ["o", "lse"], "notes": []}

    def handle_of(self, req):
        p = self.handles.get(req.get("handle"))
        if p is None:
            raise ValueError(f"unknown handle {req.get('handle')!r}")
        return p

    def to_f32(self, x):
        if self.torch is not None and isinstance(x, self.torch.Tensor):
            return x.detach().float().contiguous().cpu().numpy()
        return self.np.asarray(x, dtype=self.np.float32)

    def op_run_for_check(self, req):
        call, pr = self.handle_of(req)
        out_dir = req.get("dir")
        if not out_dir or not os.path.isdir(out_dir):
            raise ValueError(f"run_for_check needs an existing 'dir', got {out_dir!r}")
        r = call()
        self.sync()
        o, lse = (r if isinstance(r, tuple) else (r, None))
        want_o = (pr["batch"], pr["seqlen_q"], pr["heads_q"], pr["head_dim"])
        want_lse = (pr["batch"], pr["heads_q"], pr["seqlen_q"])
        files = {}
        for name, x, want in (("o", o, want_o), ("lse", lse, want_lse)):
            if x is None:
                continue
            arr = self.to_f32(x)
            if tuple(arr.shape) != want:
                raise ValueError(f"the plug-in's {name} has shape {tuple(arr.shape)}, expected {want}")
            path = os.path.join(out_dir, f"h{req['handle']}_{name}.f32")
            arr.astype("<f4").reshape(-1).tofile(path)
            files[name] = {"path": path, "len": int(arr.size)}
        return {"files": files, "peak_extra_bytes": None}

    def sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def op_sample(self, req):
        call, _ = self.handle_of(req)
        n = int(req.get("n", 1))
        if n < 1 or n > 100_000:
            raise ValueError(f"sample n must be in 1..100000, got {n}")
        ms = []
        if self.torch is None:
            for _ in range(n):
                t0 = time.perf_counter()
                r = call()
                ms.append((time.perf_counter() - t0) * 1e3)
                del r
            return {"ms": ms}
        t = self.torch
        if self.flush is None:
            nbytes = self.flush_bytes or 2 * t.cuda.get_device_properties(0).L2_cache_size
            self.flush = t.empty(max(1, nbytes // 4), dtype=t.float32, device="cuda")
        start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        for _ in range(n):
            # The flush is queued first, so the GPU is busy when the start event is recorded.
            self.flush.zero_()
            start.record()
            r = call()
            end.record()
            end.synchronize()
            del r
            ms.append(start.elapsed_time(end))
        return {"ms": ms}

    def op_release(self, req):
        return {"released": self.handles.pop(req.get("handle"), None) is not None}


def main(argv):
    device = "cpu"
    if "--device" in argv:
        i = argv.index("--device")
        if i + 1 < len(argv):
            device = argv[i + 1]
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", newline="\n")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    hello = {"protocol": PROTOCOL_VERSION, "ok": False, "reason": None, "device": device,
             "versions": {"python": platform.python_version()}, "implementations": [],
             "timer": "host clock" if device == "cpu" else "CUDA events after an L2 flush",
             "pid": os.getpid()}
    try:
        host = Host(device)
        hello["ok"] = True
        hello["versions"]["numpy"] = host.np.__version__
        if host.torch is not None:
            hello["versions"]["torch"] = host.torch.__version__
    except Exception as e:  # noqa: BLE001
        hello["reason"] = f"the plug-in host cannot start on {device}: {type(e).__name__}: {e}"
    send(hello)
    if not hello["ok"]:
        return 0
    ops = {"configure": host.op_configure, "prepare": host.op_prepare,
           "run_for_check": host.op_run_for_check, "sample": host.op_sample,
           "release": host.op_release}
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            rid, op = req.get("id"), req.get("op")
        except Exception as e:  # noqa: BLE001
            send({"id": None, "ok": False, "kind": "protocol", "error": f"bad request line: {e}"})
            continue
        if op == "quit":
            send({"id": rid, "ok": True})
            return 0
        fn = ops.get(op)
        if fn is None:
            send({"id": rid, "ok": False, "kind": "protocol", "error": f"unknown op {op!r}"})
            continue
        try:
            reply = fn(req)
            reply.update({"id": rid, "ok": True})
        except NotApplicable as e:
            reply = {"id": rid, "ok": False, "kind": "na", "error": str(e)}
        except Exception as e:  # noqa: BLE001
            log(f"{op} failed:\n{traceback.format_exc()}")
            reply = {"id": rid, "ok": False, "kind": "error", "error": f"{type(e).__name__}: {e}"}
        send(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
