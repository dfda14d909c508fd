#!/usr/bin/env python3
"""flashmoe baseline worker: PyTorch baselines timed exactly like flashmoe's native runner.

A plain script (standard library + numpy + torch, no install step) that the Rust side
(``crates/flashmoe-bench/src/runner/python.rs``) starts with the user's ``python3`` and
speaks to in versioned JSON lines: one request object per line on stdin, one reply object
per line on stdout. Everything else (logs, library chatter) goes to stderr: at start the
worker moves the process's file descriptor 1 to stderr and keeps a private duplicate for
the protocol, so a stray ``print`` in a library cannot corrupt a reply.

The full protocol, the timing method and the baselines are described in
``docs/baselines.md``. In short:

* On start the worker writes one ``hello`` line (protocol version, versions of Python,
  numpy, torch, CUDA, cuDNN, Triton, the GPU) with ``ok: false`` and a one-line
  ``reason`` when it cannot work (no torch, no CUDA in torch, ...), then exits.
* Requests ``{"id": N, "op": ...}``: ``hello``, ``configure``, ``prepare``,
  ``run_for_check``, ``sample``, ``release``, ``quit``. Replies carry the same ``id`` and
  ``ok``; failures carry ``kind`` (``na``, ``oom``, ``error``, ``protocol``) and ``error``.

Options: ``--device cuda|cpu`` (or ``FLASHMOE_WORKER_DEVICE``). ``cpu`` is a development
mode only (host clock, no L2 flush): it lets the protocol and the baselines' numerics be
tested on a machine without a GPU.
"""

import bisect
import gc
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings

PROTOCOL_VERSION = 1

ATTENTION_IMPLS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex", "torch-naive"]
MOE_IMPLS = ["moe-naive-loop", "moe-grouped-mm", "moe-dense-chain"]
# Baselines from third-party packages (flashmoe_packages.py), run when importable; the
# hello lists the others under "unavailable" with the reason.
PACKAGE_ATTENTION_IMPLS = ["fa4", "fa3", "xformers", "flashinfer-prefill"]
PACKAGE_MOE_IMPLS = ["vllm-fused-moe", "sglang-fused-moe", "quack-grouped-gemm"]
ATTENTION_IMPLS += PACKAGE_ATTENTION_IMPLS
MOE_IMPLS += PACKAGE_MOE_IMPLS
# Decode-from-a-cache baselines (``flashmoe bench decode``): attention problems whose K/V
# are the cache, causal bottom-right. n/a when the package is not importable.
DECODE_IMPLS = ["fa-kvcache", "flashinfer-decode"]
# Varlen baselines (``flashmoe bench varlen``): problems of kind "varlen", packed q
# (total_q, Hq, D), k/v (total_k, Hkv, D), int32 cu_seqlens on the device; o in the same
# packed layout, lse (Hq, total_q). The package ones run when importable.
VARLEN_IMPLS = ["torch-varlen", "sdpa-cudnn-loop"]
PACKAGE_VARLEN_IMPLS = ["fa4-varlen", "fa3-varlen", "flashinfer-varlen"]
VARLEN_IMPLS += PACKAGE_VARLEN_IMPLS
# MLA decode baselines (``flashmoe bench mla``): problems of kind "mla", q (B, Sq, Hq, 576)
# and the dense latent cache (B, Sk, 576) (K = a latent row, V its first 512 columns, one
# KV head); o (B, Sq, Hq, 512). The package ones run when importable.
MLA_IMPLS = ["sdpa-mla"]
PACKAGE_MLA_IMPLS = ["flashinfer-mla", "flash-mla"]
MLA_IMPLS += PACKAGE_MLA_IMPLS

# Cap of the spin queued before each start event, microseconds.
MAX_SPIN_US = 2000.0
# Fraction of free device memory an implementation's S×S intermediates may take.
SXS_MEMORY_FRACTION = 0.6

MASK64 = (1 << 64) - 1

torch = None  # imported in build_hello()
F = None
np = None
fi = None  # flashmoe_inputs
pk = None  # flashmoe_packages
gr = None  # flashmoe_grad


def log(*args):
    print("[flashmoe-worker]", *args, file=sys.stderr, flush=True)


class NotApplicable(Exception):
    """The implementation cannot run this config (reported as 'n/a: reason')."""


def first_line(e):
    s = str(e).strip()
    line = s.splitlines()[0] if s else type(e).__name__
    return line if len(line) <= 300 else line[:300] + "..."


def is_oom(e):
    if torch is None:
        return False
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


def signed64(x):
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


# ------------------------------------------------------------------------- hello

def build_hello(device):
    hello = {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "ok": False,
        "reason": None,
        "versions": {"python": platform.python_version(), "numpy": "", "torch": "", "cuda": "",
                     "cudnn": "", "triton": ""},
        "gpu": None,
        "device": device,
        "timer": None,
        "flush_bytes": None,
        "implementations": ATTENTION_IMPLS + MOE_IMPLS + DECODE_IMPLS + VARLEN_IMPLS,
        "unavailable": {},
        "packages": [],
        "pid": os.getpid(),
    }
    global np, fi, pk, gr, torch, F
    try:
        import numpy
        np = numpy
        hello["versions"]["numpy"] = numpy.__version__
    except Exception as e:  # noqa: BLE001
        hello["reason"] = f"numpy not installed for {sys.executable} ({first_line(e)})"
        return hello
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import flashmoe_inputs
        import flashmoe_packages
        import flashmoe_grad
        fi, pk, gr = flashmoe_inputs, flashmoe_packages, flashmoe_grad
    except Exception as e:  # noqa: BLE001
        hello["reason"] = f"cannot import flashmoe_inputs.py / flashmoe_packages.py next to the worker ({first_line(e)})"
        return hello
    try:
        import torch as _torch
        import torch.nn.functional as _F
        torch, F = _torch, _F
    except ImportError as e:
        hello["reason"] = f"torch not installed for {sys.executable} ({first_line(e)})"
        return hello
    except Exception as e:  # noqa: BLE001
        hello["reason"] = f"torch failed to import: {first_line(e)}"
        return hello
    v = hello["versions"]
    v["torch"] = torch.__version__
    v["cuda"] = torch.version.cuda or ""
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        v["cudnn"] = "" if cudnn is None else str(cudnn)
    except Exception:  # noqa: BLE001
        v["cudnn"] = ""
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        v["triton"] = "not installed"
    torch.set_grad_enabled(False)
    hello["unavailable"], hello["packages"] = pk.availability()
    if device == "cuda":
        try:
            available = torch.cuda.is_available()
        except Exception as e:  # noqa: BLE001
            hello["reason"] = f"CUDA not available in torch: {first_line(e)}"
            return hello
        if not available:
            built = torch.version.cuda
            hello["reason"] = (f"CUDA not available in torch {torch.__version__} "
                               + (f"(built with CUDA {built}; no usable GPU or driver)" if built
                                  else "(a CPU-only build)"))
            return hello
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        hello["gpu"] = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
            "l2_bytes": l2,
            "sm_count": int(props.multi_processor_count),
        }
        hello["timer"] = "cuda events"
        hello["flush_bytes"] = default_flush_bytes(l2)
    elif device == "cpu":
        hello["gpu"] = {"name": f"cpu ({platform.processor() or platform.machine()}, development mode)",
                        "compute_capability": "", "memory_bytes": 0, "l2_bytes": 0, "sm_count": 0}
        hello["timer"] = "host clock (cpu development mode: not comparable with GPU timings)"
    else:
        hello["reason"] = f"unknown device '{device}': expected cuda or cpu"
        return hello
    hello["ok"] = True
    return hello


def default_flush_bytes(l2_bytes):
    """Twice the L2 size, and at least 100 MiB."""
    return max(2 * int(l2_bytes or 0), 100 << 20)


# ----------------------------------------------------------------- device inputs

class DeviceCodec:
    """The input generator and checksum on a torch device, verified against numpy.

    Generation uses int64 torch arithmetic (wrapping, logical shifts emulated by masks)
    and the same f32 operations as the Rust generator; the checksum is the bit-sliced
    FNV-1a of flashmoe_inputs on device tensors. Both are checked bit for bit against the
    numpy implementation on a sample before first use; on any mismatch the worker falls
    back to numpy on the host (slower, same bytes).
    """

    GEN_CHUNK = 1 << 24
    FNV_CHUNK = 1 << 24

    def __init__(self, device):
        self.device = device
        self.verified = None
        self.why = ""
        self._pow = {}

    # -- generator
    @staticmethod
    def _lsr(z, s):
        return (z >> s) & ((1 << (64 - s)) - 1)

    def generate(self, seed, tensor_id, n, scale, dtype):
        tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        out = torch.empty(n, dtype=tdt, device=self.device)
        key = signed64(fi.tensor_key(seed, tensor_id))
        golden, m1, m2 = signed64(fi.GOLDEN), signed64(fi.M1), signed64(fi.M2)
        sc = torch.tensor(float(np.float32(scale)), dtype=torch.float32, device=self.device)
        step = torch.tensor(2.0 / 16777216.0, dtype=torch.float32, device=self.device)
        one = torch.tensor(1.0, dtype=torch.float32, device=self.device)
        for start in range(0, n, self.GEN_CHUNK):
            stop = min(n, start + self.GEN_CHUNK)
            z = torch.arange(start, stop, dtype=torch.int64, device=self.device)
            z.mul_(golden).add_(key)
            z.bitwise_xor_(self._lsr(z, 30)).mul_(m1)
            z.bitwise_xor_(self._lsr(z, 27)).mul_(m2)
            z.bitwise_xor_(self._lsr(z, 31))
            u = self._lsr(z, 40).to(torch.float32)
            del z
            u.mul_(step).sub_(one).mul_(sc)
            out[start:stop] = u.to(tdt)
        return out

    # -- checksum
    def _powers_desc(self, n):
        p = self._pow.get(n)
        if p is None:
            host = fi._powers_desc(n)  # numpy uint64, exact
            p = torch.from_numpy(host.view(np.int64)).to(self.device)
            self._pow = {n: p}
        return p

    def _fnv_chunk(self, h, b):
        n = b.numel()
        l0 = h & 0xFF
        low = torch.zeros(n, dtype=torch.uint8, device=self.device)
        for k in range(8):
            if k == 0:
                e = b
            else:
                xm = (low ^ b) & ((1 << k) - 1)
                e = (xm * (fi.FNV_PRIME & 0xFF)) ^ xm ^ b
            ek = ((e >> k) & 1).to(torch.int32)
            inc = torch.cumsum(ek, 0, dtype=torch.int32) & 1
            plane = (inc ^ ek ^ ((l0 >> k) & 1)).to(torch.uint8)
            low |= plane << k
        d = (low ^ b).to(torch.int64) - low.to(torch.int64)
        coef = self._powers_desc(n)
        s = int(torch.sum(d * coef).item()) & MASK64
        return ((int(coef[0].item()) & MASK64) * h + s) & MASK64

    def checksum(self, t):
        b = t.contiguous().reshape(-1).view(torch.uint8)
        h = fi.FNV_OFFSET
        for start in range(0, b.numel(), self.FNV_CHUNK):
            h = self._fnv_chunk(h, b[start:start + self.FNV_CHUNK])
        return h

    # -- verification
    def verify(self):
        if self.verified is not None:
            return self.verified
        try:
            saved = self.GEN_CHUNK, self.FNV_CHUNK
            self.GEN_CHUNK, self.FNV_CHUNK = 40_000, 50_000  # exercise the chunk carries
            ok = True
            for seed, tid, n, scale, dtype in [(42, 1, 100_003, 1.0, "bf16"), (7, 12, 65_536, fi.inv_sqrt_f32(4096), "bf16"),
                                               (3, 2, 70_001, 1.0, "f16"), (5, 13, 30_000, fi.inv_sqrt_f32(11008), "f32"),
                                               (2**64 - 1, 3, 1_000, 3.0, "f16")]:
                ref = fi.generate(seed, tid, n, scale, dtype, threads=1)
                got = self.generate(seed, tid, n, scale, dtype)
                got_np = got.cpu().view(torch.int16 if dtype != "f32" else torch.int32).numpy()
                ref_bits = ref.view(np.int16 if dtype != "f32" else np.int32)
                if not np.array_equal(got_np, ref_bits):
                    ok, self.why = False, f"device generator differs from numpy ({dtype}, tensor {tid})"
                    break
                if self.checksum(got) != fi.checksum(ref, dtype):
                    ok, self.why = False, f"device checksum differs from numpy ({dtype}, tensor {tid})"
                    break
            self.GEN_CHUNK, self.FNV_CHUNK = saved
        except Exception as e:  # noqa: BLE001
            self.GEN_CHUNK, self.FNV_CHUNK = saved
            ok, self.why = False, f"device generator failed: {first_line(e)}"
        self.verified = ok
        log("input generation on", self.device if ok else f"host numpy ({self.why})")
        return ok


def host_tensor(storage, dtype, device):
    """A numpy storage array from flashmoe_inputs.generate → a torch tensor on device."""
    if dtype == "bf16":
        t = torch.from_numpy(np.ascontiguousarray(storage).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(storage))
    return t.to(device)


class InputSet:
    def __init__(self, key, tensors, checksum, path, gen_ms):
        self.key = key
        self.tensors = tensors
        self.checksum = checksum
        self.path = path
        self.gen_ms = gen_ms
        self.refs = 0
        self.derived = {}


# ------------------------------------------------------------------ baselines

def torch_dtype(dtype):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]


class Prepared:
    """One implementation bound to one config."""

    def __init__(self, impl, problem, inputs):
        self.impl = impl
        self.problem = problem
        self.inputs = inputs
        self.fn = None            # the timed call
        self.check = None         # () -> {name: tensor}, the outputs in the Rust layout
        self.outputs = []         # names written by run_for_check
        self.ceiling_only = False
        self.notes = []
        self.compile_ms = None
        self.context = None       # () -> context manager around every call
        self.spin_cycles = 0
        self.dispatch_us = None
        self.peak_extra_bytes = None
        self.output_nbytes = []
        self.events = None        # (start, end) CUDA events, made by probe()

    def ctx(self):
        if self.context is None:
            import contextlib
            return contextlib.nullcontext()
        return self.context()


def sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }


def lower_right_mask(sq, sk, device):
    """Boolean (Sq, Sk) mask, True where query i may see key j (j <= i + Sk - Sq)."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return j <= i + (sk - sq)


def window_mask(sq, sk, left, right, device):
    """Boolean (Sq, Sk) mask of a sliding window around the bottom-right diagonal d = i +
    Sk - Sq: True where d - left <= j <= d + right (-1: that side unbounded)."""
    d = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        m &= j <= d + right
    if left >= 0:
        m &= j >= d - left
    return m


class Worker:
    def __init__(self, device, hello):
        self.device = device
        self.cuda = device == "cuda"
        self.hello = hello
        self.handles = {}
        self.next_handle = 1
        self.input_sets = {}
        self.codec = DeviceCodec(device)
        self.flush_bytes = hello.get("flush_bytes") or 0
        self.flush = None
        self.cycles_per_us = None
        self.spin = True
        # `flashmoe profile` runs the worker under ncu --profile-from-start off: each
        # sample's call alone (no flush, no spin) inside cudaProfilerStart/Stop.
        self.profile_range = os.environ.get("FLASHMOE_WORKER_PROFILE_RANGE") == "1" and self.cuda
        if self.profile_range:
            self.flush_bytes, self.spin = 0, False

    # ---------------------------------------------------------------- plumbing
    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free_memory(self):
        if self.cuda:
            free, _total = torch.cuda.mem_get_info()
            return int(free)
        return 8 << 30  # development mode: pretend 8 GiB

    def cleanup(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def ensure_flush(self):
        if self.cuda and self.flush_bytes and (self.flush is None or self.flush.numel() != self.flush_bytes // 4):
            self.flush = None
            self.flush = torch.empty(self.flush_bytes // 4, dtype=torch.float32, device="cuda")

    def calibrate_spin(self):
        if not self.cuda or self.cycles_per_us is not None:
            return
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel
        self.sync()
        best = None
        for _ in range(3):
            s.record()
            torch.cuda._sleep(2_000_000)
            e.record()
            e.synchronize()
            ms = s.elapsed_time(e)
            best = ms if best is None else min(best, ms)
        self.cycles_per_us = 2_000_000 / max(best * 1000.0, 1e-3)
        log(f"spin kernel: {self.cycles_per_us:.0f} cycles/us")

    # ---------------------------------------------------------------- inputs
    def acquire_inputs(self, problem, seed):
        key = json.dumps(problem, sort_keys=True) + f"|seed={seed}"
        s = self.input_sets.get(key)
        if s is None:
            for k in [k for k, v in self.input_sets.items() if v.refs == 0]:
                del self.input_sets[k]
            self.cleanup()
            t0 = time.perf_counter()
            dtype = fi.problem_dtype(problem)
            if dtype not in fi.DTYPES:
                raise NotApplicable(f"unknown dtype '{dtype}'")
            specs = fi.problem_specs(problem)
            tensors, parts = {}, []
            on_device = self.codec.verify()
            for name, tid, shape, scale in specs:
                n = math.prod(shape)
                if on_device:
                    t = self.codec.generate(seed, tid, n, scale, dtype)
                    parts.append(self.codec.checksum(t))
                else:
                    storage = fi.generate(seed, tid, n, scale, dtype)
                    parts.append(fi.checksum(storage, dtype))
                    t = host_tensor(storage, dtype, self.device)
                    del storage
                tensors[name] = t.reshape(shape)
            self.sync()
            gen_ms = (time.perf_counter() - t0) * 1e3
            s = InputSet(key, tensors, fi.fold_checksums(parts), "device" if on_device else "host numpy", gen_ms)
            self.input_sets[key] = s
            log(f"inputs {problem.get('kind')} generated in {gen_ms:.0f} ms ({s.path}), checksum {s.checksum}")
        s.refs += 1
        return s

    def release_inputs(self, s):
        s.refs -= 1
        if s.refs <= 0 and self.input_sets.get(s.key) is s:
            del self.input_sets[s.key]
            s.tensors.clear()
            s.derived.clear()
            self.cleanup()

    # ---------------------------------------------------------------- ops
    def op_configure(self, req):
        if self.profile_range:
            return {"flush_bytes": 0, "spin": False, "profile_range": True}
        if "flush_bytes" in req and req["flush_bytes"] is not None:
            self.flush_bytes = int(req["flush_bytes"])
            self.flush = None
        if "spin" in req:
            self.spin = bool(req["spin"])
        return {"flush_bytes": self.flush_bytes, "spin": self.spin}

    def op_prepare(self, req):
        impl, problem, seed = req.get("impl"), req.get("problem"), int(req.get("seed", 0))
        if not isinstance(problem, dict):
            raise ValueError("prepare needs a 'problem' object")
        kind = problem.get("kind")
        # Gradient configs (``flashmoe_grad.py``): the baselines with a backward.
        if kind == "grad":
            if impl not in gr.ATTENTION + gr.MOE:
                raise NotApplicable(f"{impl} has no backward baseline")
        elif (impl in ATTENTION_IMPLS + DECODE_IMPLS and kind != "attention"
                or impl in MOE_IMPLS and kind != "moe"
                or impl in VARLEN_IMPLS and kind != "varlen"
                or impl in MLA_IMPLS and kind != "mla"):
            raise NotApplicable(f"{impl} does not run {kind} problems")
        if (kind != "grad"
                and impl not in ATTENTION_IMPLS + MOE_IMPLS + DECODE_IMPLS + VARLEN_IMPLS + MLA_IMPLS):
            raise NotApplicable(f"unknown implementation '{impl}'")
        t0 = time.perf_counter()
        inputs = self.acquire_inputs(problem, seed)
        try:
            p = Prepared(impl, problem, inputs)
            if kind == "grad":
                gr.build(self, p, torch, F, NotApplicable)
            elif kind == "attention":
                self.build_attention(p)
            elif kind == "varlen":
                self.build_varlen(p)
            elif kind == "mla":
                self.build_mla(p)
            else:
                self.build_moe(p)
            self.probe(p)
        except BaseException:
            self.release_inputs(inputs)
            raise
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = p
        return {
            "handle": h,
            "input_checksum": inputs.checksum,
            "input_path": inputs.path,
            "outputs": p.outputs,
            "ceiling_only": p.ceiling_only,
            "compile_ms": p.compile_ms,
            "prepare_ms": (time.perf_counter() - t0) * 1e3,
            "dispatch_us": p.dispatch_us,
            "spin_us": (p.spin_cycles / self.cycles_per_us) if self.cycles_per_us else 0.0,
            "notes": p.notes,
        }

    def handle_of(self, req):
        h = req.get("handle")
        p = self.handles.get(h)
        if p is None:
            raise ValueError(f"unknown handle {h!r} (released, or from an earlier worker)")
        return p

    def op_run_for_check(self, req):
        p = self.handle_of(req)
        out_dir = req.get("dir")
        if not out_dir or not os.path.isdir(out_dir):
            raise ValueError(f"run_for_check needs an existing 'dir', got {out_dir!r}")
        # Poison: hand the allocator NaN-filled blocks of the outputs' sizes, so an
        # implementation that leaves part of its output unwritten shows NaN, not stale data.
        for nbytes in p.output_nbytes:
            junk = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=self.device)
            del junk
        self.sync()
        base = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with p.ctx():
            outs = p.check()
        self.sync()
        out_bytes = sum(t.numel() * t.element_size() for t in outs.values())
        if self.cuda:
            p.peak_extra_bytes = max(0, torch.cuda.max_memory_allocated() - base - out_bytes)
        files = {}
        for name, t in outs.items():
            if name not in p.outputs:
                continue
            t = t.detach()
            if name == "topk_ids":
                arr = t.to(torch.int64).cpu().numpy().astype("<u4")
                path = os.path.join(out_dir, f"h{req['handle']}_{name}.u32")
            else:
                arr = t.float().contiguous().cpu().numpy().astype("<f4", copy=False)
                path = os.path.join(out_dir, f"h{req['handle']}_{name}.f32")
            arr.reshape(-1).tofile(path)
            files[name] = {"path": path, "len": int(arr.size), "shape": list(t.shape)}
        del outs
        return {"files": files, "peak_extra_bytes": p.peak_extra_bytes, "notes": p.notes}

    def op_sample(self, req):
        p = self.handle_of(req)
        n = int(req.get("n", 1))
        if n < 1 or n > 100_000:
            raise ValueError(f"sample n must be in 1..100000, got {n}")
        ms = []
        with p.ctx():
            if self.cuda:
                self.ensure_flush()
                start, end = p.events
                flush, spin = self.flush, p.spin_cycles if self.spin else 0
                for _ in range(n):
                    # The L2 flush and a short spin are queued first, so the GPU is busy
                    # while the host records the start event and dispatches the call:
                    # host launch latency is not counted as kernel time.
                    if flush is not None:
                        flush.zero_()
                    if spin:
                        torch.cuda._sleep(spin)
                    if self.profile_range:
                        torch.cuda.profiler.start()
                    start.record()
                    r = p.fn()
                    end.record()
                    end.synchronize()
                    if self.profile_range:
                        torch.cuda.profiler.stop()
                    del r
                    ms.append(start.elapsed_time(end))
            else:
                for _ in range(n):
                    t0 = time.perf_counter()
                    r = p.fn()
                    del r
                    ms.append((time.perf_counter() - t0) * 1e3)
        return {"ms": ms}

    def op_release(self, req):
        h = req.get("handle")
        p = self.handles.pop(h, None)
        if p is not None:
            self.release_inputs(p.inputs)
        return {"released": p is not None}

    # ---------------------------------------------------------------- probe
    def probe(self, p):
        """Run the check once (rejections → n/a), then measure the host dispatch time."""
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with p.ctx():
                    outs = p.check()
                    self.sync()
            except NotApplicable:
                raise
            except Exception as e:  # noqa: BLE001
                if is_oom(e):
                    raise
                reasons = [first_line(w.message) for w in caught if "kernel" in str(w.message).lower()
                           or "attention" in str(w.message).lower()]
                msg = first_line(e)
                if reasons:
                    msg += " (" + "; ".join(dict.fromkeys(reasons)) + ")"
                raise NotApplicable(msg) from e
        if p.compile_ms is None and p.impl == "flex":
            p.compile_ms = (time.perf_counter() - t0) * 1e3
        p.output_nbytes = [t.numel() * t.element_size() for t in outs.values()]
        del outs
        # Warm the timed call and measure how long the host takes to dispatch it.
        times = []
        with p.ctx():
            for _ in range(4):
                self.sync()
                t1 = time.perf_counter()
                r = p.fn()
                times.append((time.perf_counter() - t1) * 1e6)
                self.sync()
                del r
        p.dispatch_us = max(times[1:])
        if self.cuda:
            self.calibrate_spin()
            spin_us = min(MAX_SPIN_US, 2.0 * p.dispatch_us + 50.0)
            p.spin_cycles = int(spin_us * self.cycles_per_us)
            p.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    # ---------------------------------------------------------------- attention
    def attention_layouts(self, inputs, expand):
        """(B, H, S, D) contiguous copies of q, k, v (k, v expanded to Hq heads if asked)."""
        key = "bhsd_expanded" if expand else "bhsd"
        got = inputs.derived.get(key)
        if got is None:
            base = inputs.derived.get("bhsd")
            if base is None:
                t = inputs.tensors
                base = tuple(t[n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))
                inputs.derived["bhsd"] = base
                # The (B, S, H, D) originals are no longer needed: keep one copy on the GPU.
                for n in ("q", "k", "v"):
                    t[n] = None
            if expand:
                q, k, v = base
                g = q.shape[1] // k.shape[1]
                got = (q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))
            else:
                got = base
            inputs.derived[key] = got
        return got

    def build_attention(self, p):
        pr = p.problem
        b, hq, hkv = pr["batch"], pr["heads_q"], pr["heads_kv"]
        sq, sk, d = pr["seqlen_q"], pr["seqlen_k"], pr["head_dim"]
        causal = bool(pr["causal"])
        dt = torch_dtype(pr["dtype"])
        scale = pr.get("softmax_scale")
        scale = float(np.float32(scale)) if scale is not None else float(np.float32(1.0) / np.sqrt(np.float32(d)))
        gqa = hq != hkv
        mode = "none" if not causal else ("square" if sq == sk else "lower_right")
        p.outputs = ["o", "lse"]
        # Sliding window (left, right; causal bounds the right side at 0) and softcap.
        window = tuple(pr.get("window") or (-1, -1))
        left, right = int(window[0]), (0 if causal else int(window[1]))
        softcap = float(pr.get("softcap") or 0.0)
        windowed = left >= 0 or right > 0
        if (windowed or softcap > 0) and (p.impl.startswith("sdpa-") or p.impl in DECODE_IMPLS):
            raise NotApplicable("no sliding-window or softcap option (a dense mask would also "
                                "time the hidden keys)")

        def to_bshd(o):
            return o.transpose(1, 2)

        if p.impl.startswith("sdpa-"):
            self.build_sdpa(p, b, hq, sq, sk, d, gqa, mode, scale, to_bshd)
        elif p.impl == "flex":
            self.build_flex(p, sq, sk, gqa, causal, scale, to_bshd, (left, right), softcap)
        elif p.impl in DECODE_IMPLS:
            self.build_kvcache(p, b, hq, hkv, sq, sk, d, causal, scale)
        elif p.impl in PACKAGE_ATTENTION_IMPLS:
            if not self.cuda:
                raise NotApplicable(f"{p.impl} needs CUDA")
            q, k, v = self.bshd_inputs(p)
            a = pk.Attn(torch, q, k, v, b, hq, hkv, sq, sk, d, causal, scale, (left, right), softcap)
            try:
                pk.build_attention(p.impl, p, a, self.sync, spot_check_lse)
            except pk.Unavailable as e:
                raise NotApplicable(str(e)) from None
        elif p.impl == "torch-naive":
            need = b * hq * sq * sk * (2 * dt.itemsize + 8) + (sq * sk if causal else 0)
            free = self.free_memory()
            if need > SXS_MEMORY_FRACTION * free:
                raise NotApplicable(f"the S×S intermediates need {need / 2**30:.1f} GiB, "
                                    f"{free / 2**30:.1f} GiB free on the device")
            q, k, v = self.attention_layouts(p.inputs, expand=gqa)
            if gqa:
                p.notes.append("K/V heads expanded to Hq outside the timed region")
            if windowed:
                mask = window_mask(sq, sk, left, right, self.device)
            else:
                mask = lower_right_mask(sq, sk, self.device) if causal else None

            def scores():
                s = torch.matmul(q, k.transpose(-1, -2)).float()
                s.mul_(scale)
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if mask is not None:
                    s.masked_fill_(~mask, float("-inf"))
                return s

            def fn():
                pr_ = torch.softmax(scores(), dim=-1).to(dt)
                return torch.matmul(pr_, v)

            def check():
                s = scores()
                o = torch.matmul(torch.softmax(s, dim=-1).to(dt), v)
                return {"o": to_bshd(o), "lse": torch.logsumexp(s, dim=-1)}

            p.fn, p.check = fn, check
            p.notes.append("LSE computed from the same S matrix in the check run only (not timed)")
        else:
            raise NotApplicable(f"unknown attention implementation '{p.impl}'")

    def build_sdpa(self, p, b, hq, sq, sk, d, gqa, mode, scale, to_bshd):
        from torch.nn.attention import sdpa_kernel
        backend = sdpa_backends()[p.impl]
        if p.impl == "sdpa-math":
            need = 3 * b * hq * sq * sk * 4
            free = self.free_memory()
            if need > SXS_MEMORY_FRACTION * free:
                raise NotApplicable(f"the math backend's S×S matrices need about {need / 2**30:.1f} GiB, "
                                    f"{free / 2**30:.1f} GiB free on the device")
        p.context = lambda: sdpa_kernel([backend])
        mask = lower_right_mask(sq, sk, self.device) if mode == "lower_right" and p.impl != "sdpa-flash" else None
        aten = torch.ops.aten

        def make(expand):
            q, k, v = self.attention_layouts(p.inputs, expand=expand and gqa)
            kw = {"scale": scale}
            if gqa and not expand:
                kw["enable_gqa"] = True
            if mode == "square":
                kw["is_causal"] = True
            elif mode == "lower_right" and p.impl == "sdpa-flash":
                # What torch's own causal_lower_right does for flash: flash's is_causal is
                # bottom-right aligned. (SDPA's is_causal is top-left when Sq != Sk.)
                return (q, k, v), (lambda: aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, True, False, scale=scale)[0])
            elif mode == "lower_right":
                kw["attn_mask"] = mask
            return (q, k, v), (lambda: F.scaled_dot_product_attention(q, k, v, **kw))

        def lse_for(q, k, v, o_public):
            """LSE from the backend's own op (check run only), if it agrees with the public call."""
            try:
                if p.impl == "sdpa-flash":
                    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, mode != "none", False, scale=scale)
                elif p.impl == "sdpa-efficient" and mode != "lower_right":
                    r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, mode == "square",
                                                                     scale=scale)
                elif p.impl == "sdpa-cudnn" and mode != "lower_right":
                    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, mode == "square", False,
                                                                 scale=scale)
                else:
                    return None, "the public SDPA API returns no LSE"
            except Exception as e:  # noqa: BLE001
                return None, f"the backend's LSE op failed ({first_line(e)})"
            o2, lse = r[0], r[1]
            if o2.shape != o_public.shape or not torch.equal(o2, o_public):
                diff = (o2.float() - o_public.float()).abs().max().item() if o2.shape == o_public.shape else None
                if diff is None or diff > 1e-3:
                    return None, f"the backend's LSE op computed a different O (max diff {diff})"
            if lse.numel() < b * hq * sq:
                return None, f"the backend's LSE has shape {tuple(lse.shape)}"
            lse = lse.reshape(b, hq, -1)[..., :sq].float()
            ok, why = spot_check_lse(lse, q, k, scale, mode, sq, sk)
            if not ok:
                return None, why
            return lse, None

        (q, k, v), fn = make(False)
        if gqa:
            try:
                with sdpa_kernel([backend]), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn()
                    self.sync()
            except Exception as e:  # noqa: BLE001
                if is_oom(e):
                    raise
                (q, k, v), fn = make(True)
                p.notes.append(f"backend rejected enable_gqa ({first_line(e)}): K/V heads expanded "
                               "to Hq outside the timed region")
        if mode == "lower_right":
            p.notes.append("Sq != Sk causal: bottom-right aligned via "
                           + ("the flash op's own causal flag" if p.impl == "sdpa-flash" else "an explicit boolean mask"))
        p.fn = fn
        state = {"lse_note": None}

        def check():
            o = fn()
            lse, why = lse_for(q, k, v, o)
            out = {"o": to_bshd(o)}
            if lse is not None:
                out["lse"] = lse
            elif state["lse_note"] is None:
                state["lse_note"] = f"LSE not reported: {why[:200]}"
                p.notes.append(state["lse_note"])
            return out

        p.check = check

    def bshd_inputs(self, p):
        """q, k, v as contiguous (B, S, H, D) tensors (flashmoe's own layout)."""
        t = p.inputs.tensors
        if any(t.get(n) is None for n in ("q", "k", "v")):
            # An SDPA baseline kept only its (B, H, S, D) copies: back to (B, S, H, D), once.
            got = p.inputs.derived.get("bshd")
            if got is None:
                got = tuple(x.transpose(1, 2).contiguous() for x in p.inputs.derived["bhsd"])
                p.inputs.derived["bshd"] = got
            return got
        return t["q"], t["k"], t["v"]

    def build_kvcache(self, p, b, hq, hkv, sq, sk, d, causal, scale):
        """flash_attn_with_kvcache on the dense (B, Sk, Hkv, D) cache, or FlashInfer's batch
        decode over the same cache viewed as pages of 16 keys (Sq = 1 only)."""
        if not self.cuda:
            raise NotApplicable(f"{p.impl} needs CUDA")
        q, k, v = self.bshd_inputs(p)
        if p.impl == "fa-kvcache":
            try:
                from flash_attn import flash_attn_with_kvcache
            except Exception as e:  # noqa: BLE001
                raise NotApplicable(f"flash_attn not importable ({first_line(e)})")

            def fn():
                return flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=causal)

            def check():
                o, lse = flash_attn_with_kvcache(q, k, v, softmax_scale=scale, causal=causal,
                                                 return_softmax_lse=True)
                return {"o": o, "lse": lse.float().reshape(b, hq, sq)}

            p.outputs = ["o", "lse"]
            p.fn, p.check = fn, check
            p.notes.append("flash_attn_with_kvcache on the dense cache (causal bottom-right)")
            return
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001
            raise NotApplicable(f"flashinfer not importable ({first_line(e)})")
        page = 16
        if sq != 1 or sk % page != 0:
            raise NotApplicable("FlashInfer batch decode: Sq = 1 and Sk a multiple of 16 only")
        npages = sk // page
        kp = k.reshape(b * npages, page, hkv, d)
        vp = v.reshape(b * npages, page, hkv, d)
        indptr = torch.arange(b + 1, dtype=torch.int32, device=self.device) * npages
        indices = torch.arange(b * npages, dtype=torch.int32, device=self.device)
        last = torch.full((b,), page, dtype=torch.int32, device=self.device)
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=self.device)
        # FlashInfer recommends its tensor-core (prefill) kernels for GQA groups of 4 and more.
        tensor_cores = hq // hkv >= 4
        q3 = q.reshape(b, hq, d)
        # The plan and the first call (FlashInfer JIT-compiles its module on a new
        # machine) run here, untimed.
        t0 = time.perf_counter()
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
            w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=q.dtype, kv_data_type=k.dtype,
                   sm_scale=scale)

            def fn():
                return w.run(q3, (kp, vp))

            fn()
            torch.cuda.synchronize()
            p.compile_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001
            if "out of memory" in str(e).lower():
                raise
            raise NotApplicable(f"flashinfer rejected the config: {first_line(e)}")

        p.outputs = ["o"]
        p.fn = fn
        p.check = lambda: {"o": fn().reshape(b, sq, hq, d)}
        p.notes.append(f"FlashInfer batch decode over the dense cache as pages of 16 (identity table), "
                       f"use_tensor_cores={tensor_cores}; plan and first call (JIT compile on a new machine) "
                       f"{p.compile_ms / 1e3:.1f} s, outside the timing; "
                       "LSE not reported (O checked only)")

    def build_flex(self, p, sq, sk, gqa, causal, scale, to_bshd, window=(-1, -1), softcap=0.0):
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except Exception as e:  # noqa: BLE001
            raise NotApplicable(f"FlexAttention not available in torch {torch.__version__} ({first_line(e)})")
        try:
            from torch.nn.attention.flex_attention import AuxRequest
        except Exception:  # noqa: BLE001
            AuxRequest = None
        # Compile per config: reset dynamo and keep its recompile limit high, so the call
        # never silently falls back to the unfused path (≈50× slower) after the limit.
        torch._dynamo.reset()
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                try:
                    setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
                except Exception:  # noqa: BLE001
                    pass
        q, k, v = self.attention_layouts(p.inputs, expand=False)
        block_mask = None
        left, right = window
        if causal or left >= 0 or right >= 0:
            offset = sk - sq
            right = 0 if causal else right

            def mask_mod(b_, h_, q_idx, kv_idx):
                d = q_idx + offset
                keep = kv_idx >= 0
                if right >= 0:
                    keep = keep & (kv_idx <= d + right)
                if left >= 0:
                    keep = keep & (kv_idx >= d - left)
                return keep

            block_mask = create_block_mask(mask_mod, None, None, sq, sk, device=self.device)
        compiled = torch.compile(flex_attention, dynamic=False)
        kw = {"block_mask": block_mask, "scale": scale}
        if softcap > 0:
            def score_mod(score, b_, h_, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            kw["score_mod"] = score_mod
        if gqa:
            kw["enable_gqa"] = True
        base_kw = dict(kw)
        if AuxRequest is not None:
            kw["return_aux"] = AuxRequest(lse=True)
        else:
            kw["return_lse"] = True

        state = {"lse": True}

        def call():
            if not state["lse"]:
                return compiled(q, k, v, **base_kw), None
            out, aux = compiled(q, k, v, **kw)
            return out, (aux.lse if AuxRequest is not None else aux)

        def fn():
            return call()

        def check():
            o, lse = call()
            out = {"o": to_bshd(o)}
            if lse is not None:
                out["lse"] = lse.float()
            return out

        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    call()
                    self.sync()
                except Exception as e:  # noqa: BLE001
                    if is_oom(e):
                        raise
                    # Some builds cannot return the LSE (e.g. CPU inductor): time O alone.
                    state["lse"] = False
                    torch._dynamo.reset()
                    call()
                    self.sync()
                    p.notes.append(f"LSE not reported: flex_attention with LSE failed ({first_line(e)[:160]})")
        except Exception as e:  # noqa: BLE001
            if is_oom(e):
                raise
            raise NotApplicable(f"flex_attention failed to compile or run: {first_line(e)}") from e
        p.compile_ms = (time.perf_counter() - t0) * 1e3
        p.notes.append(f"torch.compile(flex_attention) for this config took {p.compile_ms / 1e3:.1f} s "
                       "(not timed; dynamo reset per config)")
        p.fn, p.check = fn, check

    # ---------------------------------------------------------------- varlen
    def build_varlen(self, p):
        """A varlen baseline on the packed inputs (see VARLEN_IMPLS for the layouts)."""
        pr = p.problem
        lens = [(int(s[0]), int(s[1])) for s in pr["seqlens"]]
        hq, hkv, d = int(pr["heads_q"]), int(pr["heads_kv"]), int(pr["head_dim"])
        causal = bool(pr["causal"])
        scale = pr.get("softmax_scale")
        explicit_scale = scale is not None
        scale = float(np.float32(scale)) if explicit_scale else float(np.float32(1.0) / np.sqrt(np.float32(d)))
        window = tuple(pr.get("window") or (-1, -1))
        # (left, right) around each sequence's bottom-right diagonal, causal folded in.
        window = (int(window[0]), 0 if causal else int(window[1]))
        softcap = float(pr.get("softcap") or 0.0)
        cu = p.inputs.derived.get("cu_seqlens")
        if cu is None:
            cu_q, cu_k = varlen_offsets(s[0] for s in lens), varlen_offsets(s[1] for s in lens)
            cu = (cu_q, cu_k, torch.tensor(cu_q, dtype=torch.int32, device=self.device),
                  torch.tensor(cu_k, dtype=torch.int32, device=self.device))
            p.inputs.derived["cu_seqlens"] = cu
        t = p.inputs.tensors
        a = pk.Varlen(torch, t["q"], t["k"], t["v"], lens, cu, hq, hkv, d, causal, scale, window, softcap)
        a.explicit_scale = explicit_scale
        p.outputs = ["o", "lse"]

        def lse_check(lse):
            return spot_check_varlen_lse(lse, a)

        if p.impl == "torch-varlen":
            self.build_torch_varlen(p, a, lse_check)
        elif p.impl == "sdpa-cudnn-loop":
            self.build_sdpa_loop(p, a)
        elif p.impl in PACKAGE_VARLEN_IMPLS:
            if not self.cuda:
                raise NotApplicable(f"{p.impl} needs CUDA")
            try:
                pk.build_varlen(p.impl, p, a, self.sync, lse_check)
            except pk.Unavailable as e:
                raise NotApplicable(str(e)) from None
        else:
            raise NotApplicable(f"unknown varlen implementation '{p.impl}'")

    def build_torch_varlen(self, p, a, lse_check):
        """torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen inside PyTorch); its
        signature changed across releases (is_causal, then window_size), read at run time."""
        try:
            from torch.nn.attention import varlen as tv
            varlen_attn = tv.varlen_attn
        except Exception as e:  # noqa: BLE001
            raise NotApplicable(f"torch.nn.attention.varlen.varlen_attn is not in torch {torch.__version__} "
                                f"({first_line(e)})")
        if not self.cuda:
            raise NotApplicable("varlen_attn runs on CUDA only")
        if a.softcap > 0:
            raise NotApplicable("varlen_attn has no softcap option")
        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if "is_causal" in params:
            kw["is_causal"] = a.causal
            if a.windowed():
                if "window_size" not in params:
                    raise NotApplicable("this varlen_attn has no window_size option")
                kw["window_size"] = tuple(a.window)
        elif "window_size" in params:
            # Causal is the window (-1, 0); a causal sliding window is (left, 0).
            if a.window != (-1, -1):
                kw["window_size"] = tuple(a.window)
        else:
            raise NotApplicable("varlen_attn takes neither is_causal nor window_size in this torch")
        if "enable_gqa" in params:
            # Newer torch wants GQA asked for; older ones take Hkv < Hq as it is.
            kw["enable_gqa"] = a.hq != a.hkv
        if "scale" in params:
            kw["scale"] = a.scale
        elif a.explicit_scale:
            raise NotApplicable("this varlen_attn has no scale option (the config sets softmax_scale)")
        lse_kw = {}
        if "return_aux" in params and hasattr(tv, "AuxRequest"):
            lse_kw = {"return_aux": tv.AuxRequest(lse=True)}
        elif "return_lse" in params:
            lse_kw = {"return_lse": True}

        def call(**extra):
            return varlen_attn(a.q, a.k, a.v, a.cu_q, a.cu_k, a.max_q, a.max_k, **kw, **extra)

        def check():
            if lse_kw:
                o, lse = pk.split_out_lse(call(**lse_kw))
            else:
                o, lse = call(), None
            out = {"o": o}
            lse = pk.checked_varlen_lse(a, p, lse, lse_check)
            if lse is not None:
                out["lse"] = lse
            return out

        p.fn, p.check = call, check
        p.notes.append("torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen in PyTorch), packed "
                       "inputs, GQA native")

    def build_sdpa_loop(self, p, a):
        """SDPA with cuDNN forced, one call per sequence from a Python loop: what a user without
        a varlen kernel writes. The per-sequence (1, H, S, D) copies are made once, untimed."""
        if a.windowed() or a.softcap > 0:
            raise NotApplicable("no sliding-window or softcap option (a dense mask would also time the "
                                "hidden keys)")
        gqa = a.hq != a.hkv
        g = a.hq // a.hkv
        if self.cuda:
            from torch.nn.attention import sdpa_kernel
            backend = sdpa_backends()["sdpa-cudnn"]
            p.context = lambda: sdpa_kernel([backend])
        else:
            p.notes.append("CPU development mode: SDPA's CPU backend, not cuDNN")

        def make(expand):
            seqs = []
            for b, (sq, sk) in enumerate(a.lens):
                if sq == 0 or sk == 0:
                    continue  # nothing to compute / O = 0 (the zeros of check())
                q0, k0 = a.cu_q_host[b], a.cu_k_host[b]
                qb = a.q[q0:q0 + sq].transpose(0, 1).unsqueeze(0).contiguous()
                kb = a.k[k0:k0 + sk].transpose(0, 1).unsqueeze(0)
                vb = a.v[k0:k0 + sk].transpose(0, 1).unsqueeze(0)
                if expand:
                    kb, vb = kb.repeat_interleave(g, dim=1), vb.repeat_interleave(g, dim=1)
                kw = {"scale": a.scale}
                if gqa and not expand:
                    kw["enable_gqa"] = True
                if a.causal:
                    if sq == sk:
                        kw["is_causal"] = True
                    else:
                        kw["attn_mask"] = lower_right_mask(sq, sk, self.device)
                seqs.append((q0, sq, qb, kb.contiguous(), vb.contiguous(), kw))
            return seqs

        state = {"seqs": make(False)}

        def loop():
            return [F.scaled_dot_product_attention(qb, kb, vb, **kw) for (_, _, qb, kb, vb, kw) in state["seqs"]]

        if gqa:
            try:
                with p.ctx(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loop()
                    self.sync()
            except Exception as e:  # noqa: BLE001
                if is_oom(e):
                    raise
                state["seqs"] = make(True)
                p.notes.append(f"backend rejected enable_gqa ({first_line(e)}): K/V heads expanded to Hq "
                               "outside the timed region")

        def check():
            o = torch.zeros(a.total_q, a.hq, a.d, dtype=a.q.dtype, device=a.q.device)
            for (q0, sq, *_), ob in zip(state["seqs"], loop()):
                o[q0:q0 + sq] = ob[0].transpose(0, 1)
            return {"o": o}

        p.fn, p.check, p.outputs = loop, check, ["o"]
        p.notes.append(f"SDPA{' (cuDNN forced)' if self.cuda else ''} called once per sequence from a Python "
                       f"loop ({len(state['seqs'])} calls, host dispatch included); LSE not reported "
                       "(O checked only)")
        if a.causal and any(sq != sk for sq, sk in a.lens if sq and sk):
            p.notes.append("Sq != Sk causal: bottom-right aligned via an explicit boolean mask")

    # ---------------------------------------------------------------- MLA
    def build_mla(self, p):
        """MLA decode: q (B, Sq, Hq, 576) against one latent KV head (B, Sk, 576); causal
        bottom-right (row i of a sequence of n keys sees keys j <= n - Sq + i); o (B, Sq, Hq,
        512). The lab's default scale is DeepSeek's 1/sqrt(192) (mla/mod.rs)."""
        pr = p.problem
        b, hq, sq, sk = pr["batch"], pr["heads_q"], pr["seqlen_q"], pr["seqlen_k"]
        page = int(pr["page_size"])
        scale = pr.get("softmax_scale")
        scale = float(np.float32(scale)) if scale is not None else \
            float(np.float32(1.0) / np.sqrt(np.float32(192.0)))
        lens = [int(n) for n in (pr.get("seqlens_k") or [sk] * b)]
        q, kv = p.inputs.tensors["q"], p.inputs.tensors["kv"]
        if p.impl in PACKAGE_MLA_IMPLS:
            if not self.cuda:
                raise NotApplicable(f"{p.impl} needs CUDA")
            a = pk.Mla(torch, q, kv, b, hq, sq, sk, lens, scale, page)
            try:
                pk.build_mla(p.impl, p, a, self.sync)
            except pk.Unavailable as e:
                raise NotApplicable(str(e)) from e
            return
        # SDPA: the one KV head is shared by every query head, so the heads fold into the
        # query rows (row r = i · Hq + h of sequence b) against a single-head cache: the
        # enable_gqa broadcast without expanding K/V to Hq copies (128 × the cache).
        k = kv.unsqueeze(1)                # (B, 1, Sk, 576)
        v = kv[..., :512].unsqueeze(1)     # (B, 1, Sk, 512), a view: V is the latent
        qf = q.reshape(b, 1, sq * hq, 576)
        mask = None
        if sq > 1 or any(n != sk for n in lens):
            i = torch.arange(sq * hq, device=q.device) // hq
            j = torch.arange(sk, device=q.device)
            n = torch.tensor(lens, device=q.device).view(b, 1, 1)
            mask = (j.view(1, 1, sk) <= n - sq + i.view(1, sq * hq, 1)).unsqueeze(1)

        def fn():
            return F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)

        p.fn = fn
        p.outputs = ["o"]
        p.check = lambda: {"o": fn().reshape(b, sq, hq, 512)}
        p.notes.append("SDPA (backend of torch's choice) on the latent as one KV head, the "
                       f"{hq} query heads folded into the rows"
                       + (", boolean bottom-right causal / length mask" if mask is not None else "")
                       + "; LSE not reported (O checked only)")

    # ---------------------------------------------------------------- MoE
    def build_moe(self, p):
        pr = p.problem
        t_, h_, i_, e_, k_ = pr["tokens"], pr["hidden"], pr["intermediate"], pr["experts"], pr["top_k"]
        scoring, renorm = pr["scoring"], bool(pr["renormalize"])
        shared = bool(pr.get("shared_expert"))
        dt = torch_dtype(pr["dtype"])
        x = p.inputs.tensors["x"]
        router = p.inputs.tensors["router"]
        w13 = p.inputs.tensors["w13"]
        w2 = p.inputs.tensors["w2"]
        sw13 = p.inputs.tensors.get("shared_w13")
        sw2 = p.inputs.tensors.get("shared_w2")
        router32 = p.inputs.derived.get("router32")
        if router32 is None:
            router32 = router.float()
            p.inputs.derived["router32"] = router32

        def route():
            # Same routing as the reference: fp32 logits, softmax or sigmoid scores, top-k
            # with ties to the lower expert index (stable sort), optional renormalisation.
            logits = torch.matmul(x.float(), router32)
            scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
            vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
            w, ids = vals[:, :k_], idx[:, :k_]
            if renorm:
                w = w / w.sum(dim=-1, keepdim=True)
            return w, ids

        def swiglu(h):
            return F.silu(h[:, :i_]) * h[:, i_:]

        def shared_out():
            return torch.matmul(swiglu(torch.matmul(x, sw13)), sw2).float()

        p.outputs = ["out", "topk_ids"]
        if p.impl in PACKAGE_MOE_IMPLS:
            if not self.cuda:
                raise NotApplicable(f"{p.impl} needs CUDA")
            m = pk.Moe(torch, x, w13, w2, t_, h_, i_, e_, k_, dt, route, swiglu, shared_out if shared else None)
            try:
                pk.build_moe(p.impl, p, m, p.inputs.derived)
            except pk.Unavailable as e:
                raise NotApplicable(str(e)) from None
        elif p.impl == "moe-naive-loop":
            def layer():
                w, ids = route()
                out = torch.zeros(t_, h_, dtype=torch.float32, device=self.device)
                for e in range(e_):
                    tok, slot = torch.where(ids == e)
                    if tok.numel() == 0:
                        continue
                    y = torch.matmul(swiglu(torch.matmul(x[tok], w13[e])), w2[e])
                    out.index_add_(0, tok, y.float() * w[tok, slot].unsqueeze(1))
                if shared:
                    out += shared_out()
                return out.to(dt), ids

            p.fn = layer
            p.check = lambda: dict(zip(("out", "topk_ids"), layer()))
            p.notes.append("per-expert Python loop (host syncs included, as a user's loop has them)")
        elif p.impl == "moe-grouped-mm":
            if not hasattr(torch, "_grouped_mm"):
                raise NotApplicable(f"torch._grouped_mm not in torch {torch.__version__}")
            layouts = {"w13": w13, "w2": w2}

            def layer():
                w, ids = route()
                flat = ids.reshape(-1)
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=e_)
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                tok = torch.div(order, k_, rounding_mode="floor")
                xs = x.index_select(0, tok)
                hs = torch._grouped_mm(xs, layouts["w13"], offs=offs)
                ys = torch._grouped_mm(swiglu(hs), layouts["w2"], offs=offs)
                y = torch.empty_like(ys)
                y[order] = ys
                out = (y.view(t_, k_, h_).float() * w.unsqueeze(-1)).sum(dim=1)
                if shared:
                    out += shared_out()
                return out.to(dt), ids

            try:
                layer()
                self.sync()
            except Exception as e:  # noqa: BLE001
                if is_oom(e):
                    raise
                # Some versions want the weights column-major: same values, other strides.
                layouts["w13"] = w13.transpose(-2, -1).contiguous().transpose(-2, -1)
                layouts["w2"] = w2.transpose(-2, -1).contiguous().transpose(-2, -1)
                p.notes.append(f"row-major weights rejected ({first_line(e)}): column-major copies "
                               "made outside the timed region")
            p.fn = layer
            p.check = lambda: dict(zip(("out", "topk_ids"), layer()))
            p.notes.append("tokens sorted by expert, torch._grouped_mm for gate/up and down, "
                           "deterministic weighted combine")
        elif p.impl == "moe-dense-chain":
            m = t_ * k_ + (t_ if shared else 0)
            xs = p.inputs.derived.get("dense_x")
            if xs is None:
                xs = x.repeat_interleave(k_ + (1 if shared else 0), dim=0)[:m].contiguous()
                p.inputs.derived["dense_x"] = xs
            wa, wb = w13[0], w2[0]

            def chain():
                logits = torch.matmul(x, router)
                y = torch.matmul(swiglu(torch.matmul(xs, wa)), wb)
                return logits, y

            p.fn = chain
            p.check = lambda: {"_chain": chain()[1]}
            p.outputs = []
            p.ceiling_only = True
            p.notes.append(f"ceiling only: dense GEMM chain with the layer's FLOPs ({m} rows through one "
                           "expert's weights); its output is not the MoE output and is not checked")
        else:
            raise NotApplicable(f"unknown MoE implementation '{p.impl}'")


def spot_check_lse(lse, q, k, scale, mode, sq, sk, rows=64, window=(-1, -1), softcap=0.0):
    """Compare a backend's LSE with an fp32 recomputation on a few rows (cheap). `window`
    (left, right) around the bottom-right diagonal, -1 unbounded; `softcap` 0 = off."""
    b, hq = lse.shape[0], lse.shape[1]
    hkv = k.shape[1]
    g = hq // hkv
    worst = 0.0
    n = b * hq * sq
    for r in range(min(rows, n)):
        idx = (r * 2654435761) % n
        bi, rem = divmod(idx, hq * sq)
        hi, i = divmod(rem, sq)
        s = (k[bi, hi // g].float() @ q[bi, hi, i].float()) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        d = i + (sk - sq)
        right = 0 if mode != "none" else window[1]
        if right >= 0:
            s[max(0, d + right + 1):] = float("-inf")
        if window[0] >= 0:
            s[:max(0, min(sk, d - window[0]))] = float("-inf")
        ref = torch.logsumexp(s, dim=0).item()
        got = lse[bi, hi, i].item()
        if math.isinf(ref) and math.isinf(got):
            continue
        if not (math.isfinite(ref) and math.isfinite(got)):
            return False, f"the backend's LSE is {got} where the scores give {ref}"
        worst = max(worst, abs(ref - got))
    if worst > 0.05:
        return False, f"the backend's LSE disagrees with a recomputation (max diff {worst:.3g}): not natural-log LSE"
    return True, None


def varlen_offsets(lens):
    """cu_seqlens of a list of lengths: [0, l0, l0 + l1, ...]."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + int(n))
    return cu


def spot_check_varlen_lse(lse, a, rows=64):
    """Compare a varlen LSE (Hq, total_q) with an fp32 recomputation on a few rows (cheap):
    each row's scores against its own sequence's keys, the window (a.window, causal folded)
    around the sequence's bottom-right diagonal, the softcap."""
    hq, tq = a.hq, a.total_q
    g = a.hq // a.hkv
    left, right = a.window
    worst = 0.0
    n = hq * tq
    for r in range(min(rows, n)):
        idx = (r * 2654435761) % n
        h, row = divmod(idx, tq)
        b = bisect.bisect_right(a.cu_q_host, row) - 1  # the non-empty sequence holding row
        sq, sk = a.lens[b]
        i, k0 = row - a.cu_q_host[b], a.cu_k_host[b]
        if sk == 0:
            ref = float("-inf")
        else:
            s = (a.k[k0:k0 + sk, h // g].float() @ a.q[row, h].float()) * a.scale
            if a.softcap > 0:
                s = a.softcap * torch.tanh(s / a.softcap)
            dg = i + sk - sq
            if right >= 0:
                s[max(0, dg + right + 1):] = float("-inf")
            if left >= 0:
                s[:max(0, min(sk, dg - left))] = float("-inf")
            ref = torch.logsumexp(s, dim=0).item()
        got = lse[h, row].item()
        if math.isinf(ref) and math.isinf(got) and ref < 0 and got < 0:
            continue
        if not (math.isfinite(ref) and math.isfinite(got)):
            return False, f"the backend's LSE is {got} where the scores give {ref}"
        worst = max(worst, abs(ref - got))
    if worst > 0.05:
        return False, f"the backend's LSE disagrees with a recomputation (max diff {worst:.3g}): not natural-log LSE"
    return True, None


# ------------------------------------------------------------------------- main

def main(argv):
    device = os.environ.get("FLASHMOE_WORKER_DEVICE", "cuda")
    if "--device" in argv:
        i = argv.index("--device")
        if i + 1 < len(argv):
            device = argv[i + 1]
    # Keep a private stdout for the protocol; everything printed by anyone else goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", newline="\n")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj, allow_nan=True) + "\n")
        proto.flush()

    hello = build_hello(device)
    send(hello)
    if not hello["ok"]:
        log("cannot run baselines:", hello["reason"])
        return 0
    worker = Worker(device, hello)
    ops = {
        "configure": worker.op_configure,
        "prepare": worker.op_prepare,
        "run_for_check": worker.op_run_for_check,
        "sample": worker.op_sample,
        "release": worker.op_release,
    }
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0  # the Rust side went away
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a request must be a JSON object")
        except Exception as e:  # noqa: BLE001
            send({"id": None, "ok": False, "kind": "protocol", "error": f"bad request line: {first_line(e)}"})
            continue
        rid, op = req.get("id"), req.get("op")
        if op == "quit":
            send({"id": rid, "ok": True})
            return 0
        if op == "hello":
            send(dict(hello, id=rid))
            continue
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
            if is_oom(e):
                reply = {"id": rid, "ok": False, "kind": "oom", "error": f"out of memory: {first_line(e)}"}
            else:
                log(f"{op} failed:\n{traceback.format_exc()}")
                reply = {"id": rid, "ok": False, "kind": "error", "error": f"{type(e).__name__}: {first_line(e)}"}
            try:
                worker.cleanup()
            except Exception:  # noqa: BLE001
                pass
        send(reply)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
