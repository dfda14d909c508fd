//! Development timeline of the sm_90a attention kernel: runs the production tile of each
//! configuration built with `FM_TRACE=1` (clock64 stamps at the phase boundaries of every
//! warpgroup's work tiles, see `TraceEvent` in kernels/attention/prefill/fm90_trace.cuh) and writes
//! the raw stamps for `tools/probes/sm90_trace_report.py`.
//!
//! ```text
//! cargo run --release --example sm90_trace -- OUT_DIR 128:1024:0 64:1024:1 [128:512:1:f16]
//! ```
//! Each configuration `D:S:CAUSAL[:DTYPE]` is the standard sweep's shape (16k tokens, model
//! dim 2048: batch 16384 / S, heads 2048 / D). Writes `OUT_DIR/trace-D-S-c{0,1}-DTYPE.bin`
//! (little-endian i64, layout [cta][warpgroup][tile][event]) and a `.json` header.
//! `FLASHMOE_SM90_TILE` overrides the table's tile as for the benchmark.
//! The trace build is not the production kernel (a few more instructions per tile): use it
//! for where time goes, not for how fast it runs.

use std::error::Error;
use std::path::PathBuf;

use cudarc::driver::sys;
use flashmoe::attention::prefill::{abi, select, tiles};
use flashmoe::attention::AttentionRunner;
use flashmoe::gpu::Device;
use flashmoe::inputs::{generate, TensorId};
use flashmoe::{AttentionProblem, DType};

// Mirrors of the FM_TRACE layout constants in kernels/attention/prefill/fm90_trace.cuh.
const TRACE_CTAS: usize = 132;
const TRACE_TILES: usize = 32;
const TRACE_EVENTS: usize = 12;
const TOKENS: usize = 16384;
const MODEL_DIM: usize = 2048;

fn parse_config(spec: &str) -> Result<AttentionProblem, String> {
    let f: Vec<&str> = spec.split(':').collect();
    if f.len() < 3 || f.len() > 4 {
        return Err(format!("config {spec:?}: expected D:S:CAUSAL[:DTYPE]"));
    }
    let num = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| format!("config {spec:?}: {s:?} is not a number"))
    };
    let (d, s, causal) = (num(f[0])?, num(f[1])?, num(f[2])? != 0);
    let dtype = match f.get(3).copied().unwrap_or("bf16") {
        "bf16" => DType::Bf16,
        "f16" | "fp16" => DType::F16,
        other => {
            return Err(format!(
                "config {spec:?}: dtype {other:?} is not bf16 or f16"
            ))
        }
    };
    if d == 0 || s == 0 || !TOKENS.is_multiple_of(s) || !MODEL_DIM.is_multiple_of(d) {
        return Err(format!(
            "config {spec:?}: S must divide {TOKENS} and D must divide {MODEL_DIM}"
        ));
    }
    Ok(AttentionProblem::new(
        TOKENS / s,
        MODEL_DIM / d,
        s,
        d,
        causal,
        dtype,
    ))
}

/// Address and size of the module global `name` of the module that holds `func`.
fn module_global(func: &cudarc::driver::CudaFunction, name: &str) -> Result<(u64, usize), String> {
    let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
    let mut module = std::ptr::null_mut();
    let (mut ptr, mut bytes) = (0u64, 0usize);
    // SAFETY: plain driver queries on a live function handle; out-pointers are locals.
    unsafe {
        sys::cuFuncGetModule(&mut module, func.cu_function())
            .result()
            .map_err(|e| format!("cuFuncGetModule: {e}"))?;
        sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, module, cname.as_ptr())
            .result()
            .map_err(|e| format!("cuModuleGetGlobal({name}): {e} (built without FM_TRACE=1?)"))?;
    }
    Ok((ptr, bytes))
}

fn trace_one(
    dev: &Device,
    problem: &AttentionProblem,
    out: &std::path::Path,
) -> Result<(), Box<dyn Error>> {
    // The table's tile, or the FLASHMOE_SM90_TILE override's for this head dim.
    let tile = flashmoe::attention::runner::sm90_tile_override()?
        .into_iter()
        .find(|t| t.head_dim as usize == problem.head_dim)
        .or_else(|| tiles::sm90_tile(problem.head_dim))
        .ok_or_else(|| format!("no sm_90a tile for head dim {}", problem.head_dim))?;
    let mut variant = select::sm90_variant_for(&tile, problem.dtype, abi::Masking::of(problem))?;
    variant
        .defines
        .push(("FM_TRACE".to_string(), "1".to_string()));
    let q = generate(1, TensorId::Q, problem.q_elems(), 1.0, problem.dtype);
    let k = generate(1, TensorId::K, problem.kv_elems(), 1.0, problem.dtype);
    let v = generate(1, TensorId::V, problem.kv_elems(), 1.0, problem.dtype);
    let mut runner = AttentionRunner::with_variant(dev, problem, &q, &k, &v, variant.clone())?;
    // The same defines hit the kernel cache: the function of the runner's module.
    let func = dev.load_kernel(variant.source_file, variant.entry, &variant.defines)?;
    let (ptr, bytes) = module_global(&func, "fm90_trace")?;
    let wgs = tile.consumers as usize + 1;
    let expect = TRACE_CTAS * wgs * TRACE_TILES * TRACE_EVENTS * 8;
    if bytes != expect {
        return Err(format!("fm90_trace has {bytes} bytes, this tool expects {expect}").into());
    }
    for _ in 0..3 {
        runner.run(dev)?; // warm-up: clocks, caches
    }
    dev.synchronize()?;
    // SAFETY: ptr/bytes describe the module global; the stream is idle (synchronised).
    unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes).result()? };
    dev.synchronize()?;
    runner.run(dev)?;
    dev.synchronize()?;
    let mut raw = vec![0i64; bytes / 8];
    // SAFETY: raw holds exactly `bytes`; the kernel has completed.
    unsafe { sys::cuMemcpyDtoH_v2(raw.as_mut_ptr().cast(), ptr, bytes).result()? };

    let name = format!(
        "trace-{}-{}-c{}-{}",
        problem.head_dim,
        problem.seqlen_q,
        problem.causal as u32,
        problem.dtype.name()
    );
    let bin: Vec<u8> = raw.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(out.join(format!("{name}.bin")), bin)?;
    let header = serde_json::json!({
        "problem": problem,
        "tile": format!("{tile:?}"),
        "grid": runner.launch_config().grid_dim.0,
        "ctas": TRACE_CTAS, "warpgroups": wgs, "tiles": TRACE_TILES, "events": TRACE_EVENTS,
        "device": dev.info().name,
    });
    std::fs::write(
        out.join(format!("{name}.json")),
        serde_json::to_string_pretty(&header)?,
    )?;
    println!("wrote {name} (grid {})", runner.launch_config().grid_dim.0);
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((out, specs)) = args.split_first() else {
        return Err("usage: sm90_trace OUT_DIR D:S:CAUSAL[:DTYPE] ...".into());
    };
    let problems = specs
        .iter()
        .map(|s| parse_config(s))
        .collect::<Result<Vec<_>, _>>()?;
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out)?;
    let dev = Device::open(0)?;
    if dev.arch() < 90 {
        return Err(format!("{} is not Hopper (sm_{})", dev.info().name, dev.arch()).into());
    }
    for p in &problems {
        trace_one(&dev, p, &out)?;
    }
    Ok(())
}
