//! GPU check of `mla_decode` against plain candle ops on the CPU in f32: per sequence,
//! softmax(mask(Q Cᵀ · scale)) C[:, :512] over the sequence's latent rows C (bottom-right
//! causal across the Sq rows), with the 128 or 16 query heads of a row folded into the
//! rows. Shuffled pages, NaN in every cache row no sequence uses, ragged lengths (1, page
//! ± 1, a split-many-ways 4099), Sq 1..4, bf16 and f16, u32 and i32 tables, a strided q,
//! the 4-D cache layout, a rerun bit-identical, and bad calls as errors. Returns early with
//! a note when there is no CUDA device (the CPU CI machine).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, D};
use flashmoe_candle::mla_decode;

fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("note: no CUDA device ({e}); skipping the flashmoe-candle MLA GPU test");
            None
        }
    }
}

/// xorshift64 stream: uniform values in [-1, 1) and indices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// Round f32 values to `dt` and back (what the GPU sees).
fn rounded(v: Vec<f32>, dt: DType) -> Result<Vec<f32>> {
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu)?
        .to_dtype(dt)?
        .to_dtype(DType::F32)?
        .to_vec1()
}

struct Case {
    hq: usize,
    sq: usize,
    page: usize,
    lens: Vec<usize>,
    dt: DType,
    i32_table: bool,
    strided_q: bool,
    four_d_cache: bool,
}

fn run_case(dev: &Device, c: &Case, seed: u64) -> Result<()> {
    const DQ: usize = 576;
    const DV: usize = 512;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let b = c.lens.len();
    let (hq, sq, page) = (c.hq, c.sq, c.page);
    let scale = 1.2 / (192f32).sqrt();
    let pages: Vec<usize> = c.lens.iter().map(|&n| n.div_ceil(page)).collect();
    let max_blocks = pages.iter().max().copied().unwrap() + 1;
    let num_blocks = pages.iter().sum::<usize>() + 2;
    // A shuffled block order (Fisher–Yates).
    let mut perm: Vec<usize> = (0..num_blocks).collect();
    for i in (1..num_blocks).rev() {
        perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut table = vec![0u32; b * max_blocks];
    let mut cache = vec![f32::NAN; num_blocks * page * DQ];
    let mut latent: Vec<Vec<f32>> = Vec::new();
    let mut next = 0;
    for (bi, &n) in c.lens.iter().enumerate() {
        let rows = rounded(rng.vec(n * DQ), c.dt)?;
        for j in 0..pages[bi] {
            table[bi * max_blocks + j] = perm[next] as u32;
            next += 1;
        }
        for j in 0..n {
            let blk = table[bi * max_blocks + j / page] as usize;
            let at = (blk * page + j % page) * DQ;
            cache[at..at + DQ].copy_from_slice(&rows[j * DQ..(j + 1) * DQ]);
        }
        latent.push(rows);
    }
    let q_host = rounded(rng.vec(b * sq * hq * DQ), c.dt)?;

    // Device tensors.
    let q = Tensor::from_vec(q_host.clone(), (b, sq, hq, DQ), &Device::Cpu)?;
    let q = if c.strided_q {
        // The same values in a wider row: strides (sq·hq·584, hq·584, 584, 1).
        let pad = Tensor::zeros((b, sq, hq, 8), DType::F32, &Device::Cpu)?;
        Tensor::cat(&[&q, &pad], 3)?
            .to_dtype(c.dt)?
            .to_device(dev)?
            .narrow(3, 0, DQ)?
    } else {
        q.to_dtype(c.dt)?.to_device(dev)?
    };
    let kv = Tensor::from_vec(cache, (num_blocks, page, DQ), &Device::Cpu)?.to_dtype(c.dt)?;
    let kv = if c.four_d_cache {
        kv.reshape((num_blocks, page, 1, DQ))?
    } else {
        kv
    };
    let kv = kv.to_device(dev)?;
    let bt = if c.i32_table {
        let t: Vec<i32> = table.iter().map(|&x| x as i32).collect();
        Tensor::from_vec(t, (b, max_blocks), dev)?
    } else {
        Tensor::from_vec(table, (b, max_blocks), dev)?
    };
    let lens: Vec<u32> = c.lens.iter().map(|&n| n as u32).collect();
    let seqlens = Tensor::from_vec(lens, b, &Device::Cpu)?.to_device(dev)?;
    let max_k = *c.lens.iter().max().unwrap();

    let got = mla_decode(&q, &kv, &bt, &seqlens, scale, Some(max_k))?;
    assert_eq!(got.dims(), &[b, sq, hq, DV]);
    let again = mla_decode(&q, &kv, &bt, &seqlens, scale, None)?;
    let got = got.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let again = again.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;

    // Reference per sequence: rows (i, h) folded, bottom-right causal over the Sq rows.
    let mut worst = 0f32;
    let mut err2 = 0f64;
    let mut ref2 = 0f64;
    for (bi, &n) in c.lens.iter().enumerate() {
        let cmat = Tensor::from_vec(latent[bi].clone(), (n, DQ), &Device::Cpu)?;
        let qb = Tensor::from_vec(
            q_host[bi * sq * hq * DQ..(bi + 1) * sq * hq * DQ].to_vec(),
            (sq * hq, DQ),
            &Device::Cpu,
        )?;
        let scores = (qb.matmul(&cmat.t()?)? * scale as f64)?;
        let mask: Vec<f32> = (0..sq * hq)
            .flat_map(|r| {
                let last = n as i64 - sq as i64 + (r / hq) as i64;
                (0..n as i64).map(move |j| if j <= last { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (sq * hq, n), &Device::Cpu)?;
        let p = candle_nn_softmax(&(scores + mask)?)?;
        let want = p.matmul(&cmat.narrow(1, 0, DV)?.contiguous()?)?; // (sq·hq, 512)
        let want: Vec<Vec<f32>> = want.to_vec2()?;
        let gb: Vec<f32> = got.get(bi)?.flatten_all()?.to_vec1()?;
        for (r, wrow) in want.iter().enumerate() {
            let grow = &gb[r * DV..(r + 1) * DV];
            for (g, w) in grow.iter().zip(wrow) {
                assert!(g.is_finite(), "non-finite output: seq {bi} row {r}");
                worst = worst.max((g - w).abs());
                err2 += ((g - w) as f64).powi(2);
                ref2 += (*w as f64).powi(2);
            }
        }
    }
    let rel = (err2 / ref2.max(1e-30)).sqrt();
    let (tol_rel, tol_abs) = if c.dt == DType::BF16 {
        (1.6e-2, 2e-2)
    } else {
        (4e-3, 5e-3)
    };
    println!(
        "mla_decode Hq={} Sq={} page={} lens={:?} {:?}: rel-L2 {rel:.2e}, max abs {worst:.2e}",
        hq, sq, page, c.lens, c.dt
    );
    assert!(
        rel < tol_rel && worst < tol_abs,
        "rel-L2 {rel:.2e} / max abs {worst:.2e}"
    );
    let diff = (got - again)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(diff, 0.0, "a rerun (default max_seqlen_k) differs");
    Ok(())
}

/// Row softmax over the last dim, -inf entries giving 0.
fn candle_nn_softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[test]
fn mla_decode_matches_candle_reference() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let cases = [
        Case {
            hq: 128,
            sq: 1,
            page: 64,
            lens: vec![1, 63, 65, 300],
            dt: DType::BF16,
            i32_table: false,
            strided_q: false,
            four_d_cache: false,
        },
        Case {
            hq: 16,
            sq: 4,
            page: 16,
            lens: vec![4, 17, 100],
            dt: DType::F16,
            i32_table: true,
            strided_q: true,
            four_d_cache: false,
        },
        Case {
            hq: 128,
            sq: 2,
            page: 64,
            lens: vec![4099, 2],
            dt: DType::BF16,
            i32_table: true,
            strided_q: false,
            four_d_cache: true,
        },
        Case {
            hq: 128,
            sq: 3,
            page: 64,
            lens: vec![777],
            dt: DType::F16,
            i32_table: false,
            strided_q: true,
            four_d_cache: false,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_case(&dev, c, 100 + i as u64)?;
    }
    Ok(())
}

#[test]
fn mla_decode_rejects_bad_calls() -> Result<()> {
    let Some(dev) = cuda() else { return Ok(()) };
    let q = Tensor::zeros((2, 1, 16, 576), DType::BF16, &dev)?;
    let kv = Tensor::zeros((4, 64, 576), DType::BF16, &dev)?;
    let bt = Tensor::zeros((2, 2), DType::U32, &dev)?;
    let sk = Tensor::ones(2, DType::U32, &dev)?;
    let e = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(e(mla_decode(
        &q,
        &kv.to_dtype(DType::F16)?,
        &bt,
        &sk,
        0.1,
        None
    ))
    .contains("both"));
    assert!(e(mla_decode(&q.narrow(3, 0, 512)?, &kv, &bt, &sk, 0.1, None)).contains("576"));
    assert!(e(mla_decode(&q, &kv, &bt, &sk, 0.1, Some(129))).contains("capacity"));
    assert!(e(mla_decode(&q, &kv, &bt.narrow(0, 0, 1)?, &sk, 0.1, None)).contains("batch = 2"));
    // A one-key call runs (O = that key's first 512 columns).
    let got = mla_decode(&q, &kv, &bt, &sk, 0.1, None)?;
    assert_eq!(got.dims(), &[2, 1, 16, 512]);
    Ok(())
}
