//! Tests that need a GPU. On a machine without one each test prints "skipped: no GPU"
//! and passes (the NoGpu path itself is asserted in `gpu::tests`). On the GPU machine:
//! `cargo test -p flashmoe --release -- gpu_tests --nocapture --test-threads=1`.

use super::*;
use crate::attention::{self, AttentionRunner};
use crate::dtype::DType;
use crate::error::Error;
use crate::gpu::test_support::with_gpu;
use crate::problem::AttentionProblem;
use cudarc::driver::{LaunchConfig, PushKernelArg};

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("flashmoe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn selftest_kernel_runs() {
    with_gpu("selftest", |dev| {
        dev.selftest().unwrap();
        let info = dev.info();
        assert!(info.sm_count > 0 && info.l2_cache_bytes > 0);
        assert!(info.max_shared_memory_per_block_optin >= 48 * 1024);
        assert!(info.driver_version.contains('.'));
        assert!(
            info.compile_arch.is_some(),
            "NVRTC not found on the GPU machine"
        );
    });
}

#[test]
fn tensors_round_trip_and_poison() {
    with_gpu("tensors", |dev| {
        let xs: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) / 37.0).collect();
        for dt in [DType::F16, DType::Bf16, DType::F32] {
            let mut t = DeviceTensor::from_f32(dev, dt, &xs).unwrap();
            assert_eq!(t.len(), xs.len());
            let back = t.to_f32(dev).unwrap();
            let want: Vec<f32> = xs.iter().map(|&x| dt.round(x)).collect();
            assert_eq!(back, want, "{dt}");
            t.poison(dev).unwrap();
            assert!(t.to_f32(dev).unwrap().iter().all(|x| x.is_nan()), "{dt}");
            t.zero(dev).unwrap();
            assert!(t.to_f32(dev).unwrap().iter().all(|&x| x == 0.0), "{dt}");
            t.upload(dev, &xs).unwrap();
            assert_eq!(t.to_f32(dev).unwrap(), want);
            match t.upload(dev, &xs[1..]) {
                Err(Error::BufferSize {
                    expected, actual, ..
                }) => assert_eq!((expected, actual), (1001, 1000)),
                other => panic!("{other:?}"),
            }
            let a = DeviceTensor::alloc(dev, dt, 77).unwrap();
            assert!(a.to_f32(dev).unwrap().iter().all(|x| x.is_nan()));
        }
        let t = DeviceTensor::alloc(dev, DType::F32, 4).unwrap();
        assert!(t.as_u16("o").is_err());
        assert!(t.as_f32("o").is_ok());
    });
}

const BIG_SMEM_SOURCE: &str = r#"
extern "C" __global__ void big_smem(float* out, int n) {
    extern __shared__ float s[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = (float)i;
    __syncthreads();
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += s[n - 1 - i];
    atomicAdd(out, acc);
}
"#;

#[test]
fn dynamic_shared_memory_above_48k() {
    with_gpu("smem", |dev| {
        let f = dev
            .load_kernel_source("big_smem.cu", BIG_SMEM_SOURCE, "big_smem", &[])
            .unwrap();
        let bytes: u32 = 100 * 1024;
        let n = (bytes / 4) as i32;
        dev.set_dynamic_shared_memory("big_smem", &f, bytes)
            .unwrap();
        let mut out = DeviceTensor::from_f32(dev, DType::F32, &[0.0]).unwrap();
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: bytes,
        };
        let slice = out.as_f32_mut("out").unwrap();
        let mut b = dev.stream().launch_builder(&f);
        b.arg(slice).arg(&n);
        let r = unsafe { b.launch(cfg) };
        dev.check_launch("big_smem", r).unwrap();
        let got = out.to_f32(dev).unwrap()[0] as f64;
        let want = (n as f64) * (n as f64 - 1.0) / 2.0;
        assert!((got - want).abs() / want < 1e-5, "{got} vs {want}");
        let too_much = dev.info().max_shared_memory_per_block_optin as u32 + 1;
        assert!(matches!(
            dev.set_dynamic_shared_memory("big_smem", &f, too_much),
            Err(Error::Unsupported { .. })
        ));
    });
}

#[test]
fn launch_errors_name_the_kernel() {
    with_gpu("launch-error", |dev| {
        let f = dev
            .load_kernel_source("big_smem.cu", BIG_SMEM_SOURCE, "big_smem", &[])
            .unwrap();
        let mut out = DeviceTensor::from_f32(dev, DType::F32, &[0.0]).unwrap();
        let n = 1i32;
        // 2048 threads per block is invalid on every GPU.
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (2048, 1, 1),
            shared_mem_bytes: 0,
        };
        let slice = out.as_f32_mut("out").unwrap();
        let mut b = dev.stream().launch_builder(&f);
        b.arg(slice).arg(&n);
        let r = unsafe { b.launch(cfg) };
        let e = dev.check_launch("big_smem", r).unwrap_err().to_string();
        assert!(e.contains("big_smem"), "{e}");
        dev.synchronize().unwrap();
    });
}

#[test]
fn kernel_cache_loads_from_disk_and_recovers_from_corruption() {
    with_gpu("cache", |dev| {
        let dir = temp_dir("gpu-cache");
        let arch = dev.compile_arch().unwrap().to_string();
        let src = kernels::SELFTEST_SOURCE;
        let entry = kernels::SELFTEST_ENTRY;
        {
            let c = KernelCache::for_context(dev.context().clone(), Some(dir.clone()));
            c.load("selftest.cu", src, entry, &[], &arch).unwrap();
            c.load("selftest.cu", src, entry, &[], &arch).unwrap(); // memory hit
        }
        let cached = KernelCache::offline(Some(dir.clone()))
            .compile("selftest.cu", src, entry, &[], &arch)
            .unwrap();
        assert!(cached.from_disk);
        // Corrupt the image: a fresh cache must recompile and still load.
        std::fs::write(cached.path.as_ref().unwrap(), b"not a cubin").unwrap();
        let c = KernelCache::for_context(dev.context().clone(), Some(dir.clone()));
        c.load("selftest.cu", src, entry, &[], &arch).unwrap();
        let again = KernelCache::offline(Some(dir.clone()))
            .compile("selftest.cu", src, entry, &[], &arch)
            .unwrap();
        assert!(again.from_disk);
        assert!(again.compiled.image.starts_with(b"\x7fELF") || arch.starts_with("compute_"));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn attention_api_rejects_bad_buffers_before_launching() {
    with_gpu("attention-errors", |dev| {
        let p = AttentionProblem::new(1, 2, 16, 64, false, DType::Bf16);
        let q = DeviceTensor::alloc(dev, DType::Bf16, p.q_elems()).unwrap();
        let k = DeviceTensor::alloc(dev, DType::Bf16, p.kv_elems()).unwrap();
        let v_short = DeviceTensor::alloc(dev, DType::Bf16, p.kv_elems() - 1).unwrap();
        let v = DeviceTensor::alloc(dev, DType::Bf16, p.kv_elems()).unwrap();
        let mut o = DeviceTensor::alloc(dev, DType::Bf16, p.q_elems()).unwrap();
        let mut lse = DeviceTensor::alloc(dev, DType::F32, p.lse_elems()).unwrap();
        match attention::forward(dev, &p, &q, &k, &v_short, &mut o, &mut lse) {
            Err(Error::BufferSize { name, .. }) => assert_eq!(name, "v"),
            other => panic!("{other:?}"),
        }
        // The reference kernel writes f32: a bf16 o is rejected.
        let e = attention::reference_forward(dev, &p, &q, &k, &v, &mut o, &mut lse)
            .unwrap_err()
            .to_string();
        assert!(e.contains("buffer o"), "{e}");
    });
}

/// n values in [-1, 1), a cheap hash of (index, seed): distinct inputs per tensor.
fn test_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            (x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// Max |o - ref| and max |lse - ref| (LSE rows where both are -inf are skipped).
fn max_abs_errors(o: &[f32], ro: &[f32], lse: &[f32], rlse: &[f32]) -> (f32, f32) {
    let max_o = o
        .iter()
        .zip(ro)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let max_lse = lse
        .iter()
        .zip(rlse)
        .filter(|(a, b)| a.is_finite() || b.is_finite())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    (max_o, max_lse)
}

/// Runs the v1 kernel and the GPU reference on a small problem when the kernel
/// engineer's variants exist; compares them and checks every output was written.
#[test]
fn attention_v1_matches_gpu_reference() {
    with_gpu("attention", |dev| {
        let problems = [
            AttentionProblem::new(2, 4, 200, 64, false, DType::Bf16),
            AttentionProblem::new(1, 2, 129, 128, true, DType::F16),
            AttentionProblem {
                heads_kv: 1,
                seqlen_k: 77,
                ..AttentionProblem::new(1, 4, 33, 64, true, DType::Bf16)
            },
            // More work tiles than an H100 has SMs (256 and 192): the sm_90a kernel's
            // persistent CTAs stride over several tiles each.
            AttentionProblem::new(2, 16, 1024, 128, false, DType::Bf16),
            AttentionProblem::new(2, 16, 1024, 64, false, DType::F16),
            // Causal with more tiles than SMs: tiles of unequal cost from the dispenser.
            AttentionProblem::new(2, 16, 1000, 128, true, DType::Bf16),
            AttentionProblem::new(2, 16, 1000, 64, true, DType::Bf16),
            // Causal D=64 on the three-consumer tile, whose warpgroups pass the leading key
            // tiles their rows cannot see; with Sk > Sq
            // and Sk < Sq (some warpgroups then see no key of a tile that has keys).
            AttentionProblem::new(1, 8, 1500, 64, true, DType::F16),
            AttentionProblem {
                seqlen_k: 1900,
                ..AttentionProblem::new(1, 4, 1300, 64, true, DType::Bf16)
            },
            AttentionProblem {
                seqlen_k: 1100,
                ..AttentionProblem::new(1, 4, 1500, 64, true, DType::Bf16)
            },
            // Causal query blocks are aligned to the last row rounded up to 16, so the
            // first block starts below row 0: with Sq = 1190 (Sq16 = 1200 = 6 x 192 + 48)
            // two of its three warpgroups hold only rows < 0 (they pass), the third's first
            // warp too (it stores nothing), and the last block has 10 rows past Sq; with
            // Sk > Sq the rows < 0 would see keys.
            AttentionProblem::new(1, 4, 1190, 64, true, DType::Bf16),
            AttentionProblem {
                seqlen_k: 1400,
                ..AttentionProblem::new(2, 2, 1190, 64, true, DType::F16)
            },
            // Causal with >= 6 query blocks per head: the work order goes by groups of
            // heads, heaviest block of each head first (decode_tile). 30 heads with 11
            // blocks each on 132 CTAs: a partial group of 6 heads, then a full one of 24.
            AttentionProblem::new(3, 10, 2000, 64, true, DType::Bf16),
            AttentionProblem::new(2, 5, 1300, 128, true, DType::F16),
            // Causal with < 6 query blocks per head and more than two waves of tiles: each
            // head's blocks in turn, then only the last group (two waves of tiles) heaviest
            // block first (decode_tile in fm90_scheduler.cuh). 4 blocks per head at both head
            // dims, ragged Sq: 94 + 66 heads (D=128), 54 + 66 heads (D=64).
            AttentionProblem::new(4, 40, 500, 128, true, DType::Bf16),
            AttentionProblem::new(2, 60, 700, 64, true, DType::F16),
            // D=128 non-causal with 2 waves and a bit on 132 SMs and >= 32 key tiles: the
            // last 132 + R tiles are cut over key ranges into one slot per CTA, and the two
            // parts of each cut tile merge (SPLIT in fm90_config.cuh). 272 tiles of 33 key tiles,
            // ragged Sq and Sk, one K/V head (MQA). The three launches below also check
            // that the merge gives the same bits whichever part comes second, and that the
            // boundary records reset. (One such problem: racecheck takes ~100 s for each.)
            AttentionProblem {
                heads_kv: 1,
                seqlen_k: 4100,
                ..AttentionProblem::new(2, 17, 1000, 128, false, DType::Bf16)
            },
            // Causal with Sq > Sk: the first 300 query rows see no key, so whole work tiles
            // visit no key tile (O = 0, LSE = -inf without loading Q).
            AttentionProblem {
                seqlen_k: 500,
                ..AttentionProblem::new(1, 8, 800, 128, true, DType::Bf16)
            },
        ];
        for p in problems {
            if let Err(e) = attention::prefill::select::select_v1(&p) {
                eprintln!("attention: skipped {p}: {e}");
                continue;
            }
            let (q, k, v) = (
                test_values(p.q_elems(), 1),
                test_values(p.kv_elems(), 2),
                test_values(p.kv_elems(), 3),
            );
            // The kernel this device selects (sm_90a on Hopper) and v1.
            let mut variants = vec![attention::prefill::select::select(&p, dev.arch()).unwrap()];
            let v1 = attention::prefill::select::select_v1(&p).unwrap();
            if variants[0] != v1 {
                variants.push(v1);
            }
            for variant in variants {
                let name = variant.entry;
                let mut r = AttentionRunner::with_variant(dev, &p, &q, &k, &v, variant).unwrap();
                // Three launches: each must write everything (the sm_90a kernel's work-tile
                // dispenser resets itself at the end of a launch) and give the same bits.
                let mut first: Option<(Vec<f32>, Vec<f32>)> = None;
                for launch in 0..3 {
                    r.poison_outputs(dev).unwrap();
                    r.run(dev).unwrap();
                    let o = r.output(dev).unwrap();
                    let lse = r.lse(dev).unwrap();
                    assert!(o.iter().all(|x| x.is_finite()), "{p}: unwritten/NaN output");
                    assert!(lse.iter().all(|x| !x.is_nan()), "{p}: unwritten lse");
                    match &first {
                        None => first = Some((o, lse)),
                        Some((o0, l0)) => {
                            let same = o.iter().zip(o0).all(|(a, b)| a.to_bits() == b.to_bits())
                                && lse.iter().zip(l0).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{p}: launch {launch} differs from launch 0");
                        }
                    }
                }
                let (o, lse) = first.unwrap();
                match r.run_reference(dev) {
                    Ok((ro, rlse)) => {
                        let (max_err, max_lse) = max_abs_errors(&o, &ro, &lse, &rlse);
                        eprintln!(
                        "attention {name} {p}: max |o - ref| = {max_err:e}, max |lse - ref| = {max_lse:e}"
                    );
                        assert!(max_err < 2e-2, "{p}: max error {max_err}");
                        assert!(max_lse < 1e-2, "{p}: lse error {max_lse}");
                    }
                    Err(e) => eprintln!("attention {p}: no GPU reference: {e}"),
                }
            }
        }
    });
}

/// One call of the sm_90a kernel with `tile` on `p` (outputs poisoned first) against the GPU
/// reference: every output written and finite, max |o - ref| < 2e-2, max |lse - ref| < 1e-2.
fn sm90_tile_matches_reference(
    dev: &Device,
    what: &str,
    p: &AttentionProblem,
    tile: &attention::prefill::tiles::Sm90Tile,
    (q, k, v): (&[f32], &[f32], &[f32]),
) {
    let m = attention::prefill::abi::Masking::of(p);
    let variant = attention::prefill::select::sm90_variant_for(tile, p.dtype, m).unwrap();
    let mut r = AttentionRunner::with_variant(dev, p, q, k, v, variant).unwrap();
    r.poison_outputs(dev).unwrap();
    r.run(dev).unwrap();
    let (o, lse) = (r.output(dev).unwrap(), r.lse(dev).unwrap());
    let (ro, rlse) = r.run_reference(dev).unwrap();
    let (max_err, max_lse) = max_abs_errors(&o, &ro, &lse, &rlse);
    eprintln!("{what} {p}: max |o - ref| = {max_err:e}, max |lse - ref| = {max_lse:e}");
    assert!(
        o.iter().all(|x| x.is_finite()),
        "{what} {p}: unwritten/NaN output"
    );
    assert!(max_err < 2e-2, "{what} {p}: max error {max_err}");
    assert!(max_lse < 1e-2, "{what} {p}: lse error {max_lse}");
}

/// The sm_90a kernel's lazy O rescale (with Q from shared memory and from registers) on inputs whose row max grows by
/// far more than the lazy slack (2^8) as the key tiles are visited (last to first): the
/// keys' magnitude rises towards key 0, so the lazy path must move its reference max in
/// the middle of a row. Each is compared with the GPU reference.
#[test]
fn attention_sm90_rescale_paths_match_reference() {
    with_gpu("attention sm90 rescale", |dev| {
        let problems = [
            AttentionProblem::new(1, 2, 1024, 128, false, DType::Bf16),
            AttentionProblem::new(1, 2, 700, 64, true, DType::Bf16),
            AttentionProblem {
                seqlen_k: 900,
                ..AttentionProblem::new(1, 2, 300, 128, true, DType::F16)
            },
            AttentionProblem::new(1, 2, 2048, 64, false, DType::F16),
        ];
        for p in problems {
            let Ok(table) = attention::prefill::select::select(&p, dev.arch()) else {
                continue;
            };
            if table.entry != attention::prefill::abi::SM90_ENTRY {
                eprintln!("attention sm90 rescale: skipped (not an sm_90a device)");
                return;
            }
            let row = p.heads_kv * p.head_dim; // elements per key position
            let gain = |j: usize| 1.0 + 7.0 * (1.0 - j as f32 / p.seqlen_k as f32);
            let q: Vec<f32> = test_values(p.q_elems(), 11)
                .iter()
                .map(|x| 3.0 * x)
                .collect();
            let k: Vec<f32> = test_values(p.kv_elems(), 12)
                .iter()
                .enumerate()
                .map(|(i, x)| x * gain(i / row % p.seqlen_k))
                .collect();
            let v = test_values(p.kv_elems(), 13);
            // The inputs do what the test is for: query row 0 of head 0 (it sees every key
            // when not causal; causal rows see a prefix) has a max over all keys far above
            // its max over the first key tile visited (the last one).
            if !p.causal {
                let score = |j: usize| -> f32 {
                    (0..p.head_dim).map(|d| q[d] * k[j * row + d]).sum::<f32>()
                        * attention::softmax_scale_log2(&p)
                };
                let first_tile = (p.seqlen_k.saturating_sub(128)..p.seqlen_k)
                    .map(score)
                    .fold(f32::MIN, f32::max);
                let all = (0..p.seqlen_k).map(score).fold(f32::MIN, f32::max);
                assert!(
                    all - first_tile > 16.0,
                    "{p}: max grows by only {}",
                    all - first_tile
                );
            }
            let mut tile =
                attention::prefill::tiles::sm90_tile(p.head_dim).expect("an sm_90a head dim");
            // The lazy rescale (the kernel's only one), with Q from shared memory and from
            // registers where the tile allows it.
            for q_regs in [false, true] {
                tile.q_regs = q_regs;
                if tile.check().is_err() {
                    continue;
                }
                let what = format!("attention sm90 lazy rescale q_regs={q_regs}");
                sm90_tile_matches_reference(dev, &what, &p, &tile, (&q, &k, &v));
            }
        }
    });
}

/// The sm_90a kernel at the head dims the table does not route to it yet, on the lab's
/// tiles (`sm90_lab_tile`): D = 96 (two 64-column panels, the second half the tensor maps'
/// zero fill, P V as N = 64 + N = 32 products) and D = 256 (64-key tiles, O staged in Q's
/// rows). Partial tiles, Sq != Sk, GQA, causal, a window and a softcap (Gemma 2's at
/// D = 256), both dtypes, against the GPU reference.
#[test]
fn attention_sm90_lab_head_dims_match_reference() {
    with_gpu("attention sm90 lab dims", |dev| {
        if dev.arch() != 90 {
            eprintln!("attention sm90 lab dims: skipped (not an sm_90a device)");
            return;
        }
        for d in [96, 256] {
            let tile = attention::prefill::tiles::sm90_lab_tile(d).expect("a lab tile");
            let gqa = |b, hq, hkv, sq, sk, causal, dtype| AttentionProblem {
                heads_q: hq,
                heads_kv: hkv,
                seqlen_k: sk,
                ..AttentionProblem::new(b, hq, sq, d, causal, dtype)
            };
            let problems = [
                gqa(2, 4, 4, 1000, 1000, false, DType::Bf16),
                gqa(1, 8, 2, 333, 700, true, DType::Bf16),
                gqa(3, 4, 1, 129, 130, false, DType::F16),
                gqa(1, 2, 2, 2048, 2048, true, DType::F16),
                AttentionProblem {
                    window: (100, 0),
                    ..gqa(1, 4, 2, 600, 640, true, DType::Bf16)
                },
                AttentionProblem {
                    softcap: 30.0,
                    ..gqa(2, 4, 2, 257, 300, false, DType::Bf16)
                },
                AttentionProblem {
                    softcap: 50.0,
                    window: (256, 0),
                    ..gqa(1, 8, 4, 700, 700, true, DType::Bf16)
                },
            ];
            for (n, p) in problems.into_iter().enumerate() {
                let q = test_values(p.q_elems(), 40 + 3 * n as u32);
                let k = test_values(p.kv_elems(), 41 + 3 * n as u32);
                let v = test_values(p.kv_elems(), 42 + 3 * n as u32);
                sm90_tile_matches_reference(
                    dev,
                    "attention sm90 lab dims",
                    &p,
                    &tile,
                    (&q, &k, &v),
                );
            }
        }
    });
}
