//! CPU model of kernels/moe/backward/moe_backward.cu: each kernel restated on the host (the same
//! indexing, the same roundings to 16-bit, f32 accumulation) and driven by the plan's own
//! launch sequence ([`backward_steps`]: the parameters `backward_raw` enqueues) over a
//! fake address space whose memory starts as NaN, then checked against the f64 reference.
//! It catches wiring mistakes (strides, gathers, buffers, a region read before it is
//! written) without a GPU; the GPU tests check the kernels themselves.

use super::abi::Step;
use super::steps::backward_steps;
use super::*;
use crate::accuracy::{error_metrics_rows, tolerance};
use crate::dtype::DType;
use crate::gpu::raw::{RawTensor, RawU32};
use crate::inputs::{generate, TensorId};
use crate::moe::forward::plan::MoeClass;
use crate::problem::Scoring;
use crate::reference::moe::{route, MoeInputs};
use crate::reference::moe_backward::moe_backward_f64;
use crate::reference::moe_grouped::permute;

/// Fake device memory: one byte buffer per allocation at `(index + 1) · 2^32`, filled with
/// 0xFF (NaN in f32 and the 16-bit types).
struct Mem {
    dt: DType,
    bufs: Vec<Vec<u8>>,
}

const SPACE: u64 = 1 << 32;

impl Mem {
    fn alloc(&mut self, bytes: usize) -> u64 {
        self.bufs.push(vec![0xFF; bytes.max(1)]);
        self.bufs.len() as u64 * SPACE
    }
    fn bytes(&self, addr: u64, n: usize) -> &[u8] {
        let (b, o) = ((addr / SPACE) as usize - 1, (addr % SPACE) as usize);
        &self.bufs[b][o..o + n]
    }
    fn bytes_mut(&mut self, addr: u64, n: usize) -> &mut [u8] {
        let (b, o) = ((addr / SPACE) as usize - 1, (addr % SPACE) as usize);
        &mut self.bufs[b][o..o + n]
    }
    fn h(&self, base: u64, i: i64) -> f32 {
        let b = self.bytes(base + 2 * i as u64, 2);
        self.dt.decode_u16(&[u16::from_le_bytes([b[0], b[1]])])[0]
    }
    fn set_h(&mut self, base: u64, i: i64, v: f32) {
        let bits = self.dt.encode_u16(&[v])[0];
        self.bytes_mut(base + 2 * i as u64, 2)
            .copy_from_slice(&bits.to_le_bytes());
    }
    fn f(&self, base: u64, i: i64) -> f32 {
        let b = self.bytes(base + 4 * i as u64, 4);
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn set_f(&mut self, base: u64, i: i64, v: f32) {
        self.bytes_mut(base + 4 * i as u64, 4)
            .copy_from_slice(&v.to_le_bytes());
    }
    fn u(&self, base: u64, i: i64) -> u32 {
        let b = self.bytes(base + 4 * i as u64, 4);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put_h(&mut self, v: &[f32]) -> u64 {
        let a = self.alloc(2 * v.len());
        for (i, &x) in v.iter().enumerate() {
            self.set_h(a, i as i64, x);
        }
        a
    }
    fn put_f(&mut self, v: &[f32]) -> u64 {
        let a = self.alloc(4 * v.len());
        for (i, &x) in v.iter().enumerate() {
            self.set_f(a, i as i64, x);
        }
        a
    }
    fn put_u(&mut self, v: &[u32]) -> u64 {
        let a = self.alloc(4 * v.len());
        for (i, &x) in v.iter().enumerate() {
            self.bytes_mut(a + 4 * i as u64, 4)
                .copy_from_slice(&x.to_le_bytes());
        }
        a
    }
    fn get_h(&self, a: u64, n: usize) -> Vec<f32> {
        (0..n as i64).map(|i| self.h(a, i)).collect()
    }
}

fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// One kernel, as the CUDA source computes it (per output element; the GEMMs' k order
/// differs from the mma's, which only moves f32 rounding).
fn run(m: &mut Mem, step: Step) {
    match step {
        Step::Rows(g) => {
            let groups = if g.offsets != 0 { g.groups as i64 } else { 1 };
            for e in 0..groups {
                let (lo, hi) = if g.offsets != 0 {
                    (m.u(g.offsets, e) as i64, m.u(g.offsets, e + 1) as i64)
                } else {
                    (0, g.total_rows as i64)
                };
                for r in lo..hi {
                    let src = if g.a_gather != 0 {
                        m.u(g.row_token, r) as i64
                    } else {
                        r
                    };
                    for n in 0..g.n_cols as i64 {
                        let mut acc = 0f32;
                        for k in 0..g.k_dim as i64 {
                            acc += m.h(g.a, src * g.a_rs as i64 + k)
                                * m.h(g.b, e * g.b_gs + k * g.b_ks as i64 + n * g.b_ns as i64);
                        }
                        m.set_f(g.c, r * g.ldc as i64 + n, acc);
                    }
                }
            }
        }
        Step::Gather {
            src,
            row_token,
            dst,
            rows,
            cols,
        } => {
            let cols = cols as i64;
            for r in 0..rows as i64 {
                let from = m.u(row_token, r) as i64;
                for c in 0..cols {
                    let v = m.h(src, from * cols + c);
                    m.set_h(dst, r * cols + c, v);
                }
            }
        }
        Step::Sm90Rows(g) => {
            let (n, k) = (g.n as i64, g.k as i64);
            for e in 0..g.experts as i64 {
                let b = g.b + 2 * (e * n * k) as u64;
                for r in m.u(g.offsets, e) as i64..m.u(g.offsets, e + 1) as i64 {
                    for j in 0..n {
                        let mut acc = 0f32;
                        for kk in 0..k {
                            let bi = if g.b_kmajor { j * k + kk } else { kk * n + j };
                            acc += m.h(g.a, r * k + kk) * m.h(b, bi);
                        }
                        m.set_f(g.c, r * n + j, acc);
                    }
                }
            }
        }
        Step::Sm90Wgrad(g) => {
            let (mm, nn) = (g.m as i64, g.n as i64);
            for e in 0..g.experts as i64 {
                let (lo, hi) = (m.u(g.offsets, e) as i64, m.u(g.offsets, e + 1) as i64);
                for i in 0..mm {
                    for j in 0..nn {
                        let mut acc = 0f32;
                        for r in lo..hi {
                            acc += m.h(g.a, r * mm + i) * m.h(g.b, r * nn + j);
                        }
                        m.set_h(g.dw, (e * mm + i) * nn + j, acc);
                    }
                }
            }
        }
        Step::Wgrad(g) => {
            let (mm, nn) = (g.m_dim as i64, g.n_cols as i64);
            for e in 0..g.groups as i64 {
                let (lo, hi) = if g.offsets != 0 {
                    (m.u(g.offsets, e) as i64, m.u(g.offsets, e + 1) as i64)
                } else {
                    (0, g.total_rows as i64)
                };
                let src = |m: &Mem, gather: i32, r: i64| {
                    if gather != 0 {
                        m.u(g.row_token, r) as i64
                    } else {
                        r
                    }
                };
                for i in 0..mm {
                    for n in 0..nn {
                        let mut acc = 0f32;
                        for r in lo..hi {
                            acc += m.h(g.a, src(m, g.a_gather, r) * g.a_rs as i64 + i)
                                * m.h(g.b, src(m, g.b_gather, r) * g.b_rs as i64 + n);
                        }
                        m.set_h(g.c, e * mm * nn + i * nn + n, acc);
                    }
                }
            }
        }
        Step::Swiglu {
            slots,
            ptrs,
            inter,
            saved_gu,
        } => {
            let [gu, gm, srow, tw, dgu, wh, dw] = ptrs;
            let i2 = inter as i64;
            let gu_at = |m: &Mem, j: i64| if saved_gu { m.h(gu, j) } else { m.f(gu, j) };
            for a in 0..slots as i64 {
                let r = if srow != 0 { m.u(srow, a) as i64 } else { a };
                let w = if tw != 0 { m.f(tw, a) } else { 1.0 };
                let mut dot = 0f32;
                for j in 0..i2 {
                    let (gv, uv, gg) = (
                        gu_at(m, r * 2 * i2 + j),
                        gu_at(m, r * 2 * i2 + i2 + j),
                        m.f(gm, r * i2 + j),
                    );
                    let s = sigmoid(gv);
                    let h = gv * s * uv;
                    dot += h * gg;
                    let dh = w * gg;
                    m.set_h(dgu, r * 2 * i2 + j, dh * uv * s * (1.0 + gv * (1.0 - s)));
                    m.set_h(dgu, r * 2 * i2 + i2 + j, dh * gv * s);
                    m.set_h(wh, r * i2 + j, w * h);
                }
                if dw != 0 {
                    m.set_f(dw, a, dot);
                }
            }
        }
        Step::RouterDz([logits, ids, tw, dw, counts, dl, dz], [t, e, k, sig, rn]) => {
            let (t, e, k) = (t as i64, e as i64, k as i64);
            let (d_aux, d_z) = if dl != 0 {
                (m.f(dl, 0), m.f(dl, 1))
            } else {
                (0.0, 0.0)
            };
            for tok in 0..t {
                let z: Vec<f32> = (0..e).map(|i| m.f(logits, tok * e + i)).collect();
                let mx = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = mx + z.iter().map(|&v| (v - mx).exp()).sum::<f32>().ln();
                let s: Vec<f32> = z
                    .iter()
                    .map(|&v| {
                        if sig != 0 {
                            sigmoid(v)
                        } else {
                            (v - lse).exp()
                        }
                    })
                    .collect();
                let id: Vec<usize> = (0..k).map(|j| m.u(ids, tok * k + j) as usize).collect();
                let w: Vec<f32> = (0..k).map(|j| m.f(tw, tok * k + j)).collect();
                let g: Vec<f32> = (0..k).map(|j| m.f(dw, tok * k + j)).collect();
                let ssel: f32 = id.iter().map(|&i| s[i]).sum();
                let dot: f32 = g.iter().zip(&w).map(|(a, b)| a * b).sum();
                let renorm = rn != 0 && ssel > 0.0;
                let mut ds = vec![0f32; e as usize];
                for (j, &i) in id.iter().enumerate() {
                    ds[i] += if renorm { (g[j] - dot) / ssel } else { g[j] };
                }
                let dp: Vec<f32> = (0..e)
                    .map(|i| {
                        d_aux * e as f32 * (m.u(counts, i) as f32 / (t as f32 * k as f32))
                            / t as f32
                    })
                    .collect();
                let mut out = vec![0f32; e as usize];
                if sig == 0 {
                    let sg: f32 = (0..e as usize).map(|i| s[i] * (ds[i] + dp[i])).sum();
                    for i in 0..e as usize {
                        out[i] = s[i] * (ds[i] + dp[i] - sg);
                    }
                } else {
                    let total: f32 = s.iter().sum();
                    let pdp: f32 = if total > 0.0 {
                        (0..e as usize).map(|i| s[i] / total * dp[i]).sum()
                    } else {
                        0.0
                    };
                    for i in 0..e as usize {
                        let aux = if total > 0.0 {
                            (dp[i] - pdp) / total
                        } else {
                            0.0
                        };
                        out[i] = s[i] * (1.0 - s[i]) * (ds[i] + aux);
                    }
                }
                let cz = d_z * 2.0 * lse / t as f32;
                for i in 0..e as usize {
                    m.set_f(dz, tok * e + i as i64, out[i] + cz * (z[i] - lse).exp());
                }
            }
        }
        Step::RouterDw([x, dz, part], [t, h, e, chunk, chunks]) => {
            let (t, h, e, chunk) = (t as i64, h as i64, e as i64, chunk as i64);
            for z in 0..chunks as i64 {
                let toks = z * chunk..t.min((z + 1) * chunk);
                for c in 0..h {
                    for ex in 0..e {
                        let acc: f32 = toks
                            .clone()
                            .map(|tk| m.h(x, tk * h + c) * m.f(dz, tk * e + ex))
                            .sum();
                        m.set_f(part, (z * h + c) * e + ex, acc);
                    }
                }
            }
        }
        Step::RouterDwSum([part, dr], [chunks, outputs]) => {
            for i in 0..outputs as i64 {
                let acc: f32 = (0..chunks as i64)
                    .map(|z| m.f(part, z * outputs as i64 + i))
                    .sum();
                m.set_h(dr, i, acc);
            }
        }
        Step::Unpermute([dxp, srow, dxs, dz, router, dx], [t, h, e, k]) => {
            let (t, h, e, k) = (t as i64, h as i64, e as i64, k as i64);
            for tk in 0..t {
                for c in 0..h {
                    let mut acc = 0f32;
                    for s in 0..k {
                        acc += m.f(dxp, m.u(srow, tk * k + s) as i64 * h + c);
                    }
                    if dxs != 0 {
                        acc += m.f(dxs, tk * h + c);
                    }
                    let r: f32 = (0..e)
                        .map(|ex| m.f(dz, tk * e + ex) * m.h(router, c * e + ex))
                        .sum();
                    m.set_h(dx, tk * h + c, acc + r);
                }
            }
        }
    }
}

/// `saved_gate_up`: the forward's gate/up (x·W13 of every permuted row, rounded to 16
/// bits) is handed to the backward instead of recomputed.
fn model_case(c: MoeClass, seed: u64, sm90: bool, saved_gate_up: bool) {
    let (t, h, i, e, k, dt) = (
        c.max_tokens,
        c.hidden,
        c.intermediate,
        c.experts,
        c.top_k,
        c.dtype,
    );
    let p = c.problem(t);
    let x = MoeInputs::generate(&p, seed);
    let routing = route(&p, &x).unwrap();
    let perm = permute(&p, &routing);
    let d_out = generate(seed + 1, TensorId::MoeX, t * h, 1.0, dt);
    let mut m = Mem {
        dt,
        bufs: Vec::new(),
    };
    let r16 = |ptr, s: &[usize]| RawTensor::contiguous(ptr, dt, s).unwrap();
    let f32t = |ptr, s: &[usize]| RawTensor::contiguous(ptr, DType::F32, s).unwrap();
    let u32s = |ptr, len| RawU32 { ptr, len };
    let shared = x.shared_w13.as_ref().zip(x.shared_w2.as_ref());
    let (sw13, sw2) = match shared {
        Some((a, b)) => (Some(m.put_h(a)), Some(m.put_h(b))),
        None => (None, None),
    };
    let f64s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
    let to_u = |v: &[usize]| v.iter().map(|&a| a as u32).collect::<Vec<u32>>();
    let row_token: Vec<u32> = perm.rows.iter().map(|&(tok, _)| tok).collect();
    let gate_up = saved_gate_up.then(|| {
        let mut gu = vec![0f32; t * k * 2 * i];
        for ex in 0..e {
            for r in perm.offsets[ex]..perm.offsets[ex + 1] {
                let tok = perm.rows[r].0 as usize;
                for n in 0..2 * i {
                    gu[r * 2 * i + n] = (0..h)
                        .map(|c| x.x[tok * h + c] * x.w13[(ex * h + c) * 2 * i + n])
                        .sum();
                }
            }
        }
        r16(m.put_h(&gu), &[t * k, 2 * i])
    });
    let args = MoeBwdArgs {
        x: r16(m.put_h(&x.x), &[t, h]),
        router: r16(m.put_h(&x.router), &[h, e]),
        w13: r16(m.put_h(&x.w13), &[e, h, 2 * i]),
        w2: r16(m.put_h(&x.w2), &[e, i, h]),
        shared_w13: sw13.map(|a| r16(a, &[h, 2 * i])),
        shared_w2: sw2.map(|a| r16(a, &[i, h])),
        topk_ids: u32s(m.put_u(&routing.topk_ids), t * k),
        topk_w: f32t(m.put_f(&f64s(&routing.topk_weights)), &[t, k]),
        counts: u32s(m.put_u(&to_u(&routing.expert_counts)), e),
        saved: SavedRouting {
            logits: f32t(m.put_f(&f64s(&routing.logits)), &[t, e]),
            offsets: u32s(m.put_u(&to_u(&perm.offsets)), e + 1),
            row_token: u32s(m.put_u(&row_token), t * k),
            slot_row: u32s(m.put_u(&to_u(&perm.row_of_slot)), t * k),
        },
        saved_gate_up: gate_up,
        d_out: r16(m.put_h(&d_out), &[t, h]),
        d_losses: Some(f32t(m.put_f(&[0.7, 0.3]), &[2])),
        dx: r16(m.alloc(2 * t * h), &[t, h]),
        d_router: r16(m.alloc(2 * h * e), &[h, e]),
        dw13: r16(m.alloc(2 * e * h * 2 * i), &[e, h, 2 * i]),
        dw2: r16(m.alloc(2 * e * i * h), &[e, i, h]),
        d_shared_w13: sw13.map(|_| r16(m.alloc(2 * h * 2 * i), &[h, 2 * i])),
        d_shared_w2: sw2.map(|_| r16(m.alloc(2 * i * h), &[i, h])),
    };
    let ws = BwdWorkspaceLayout::new(&c, t, sm90, saved_gate_up).unwrap();
    let base = m.alloc(ws.bytes);
    let mut kinds = Vec::new();
    backward_steps(&c, t, &args, &ws, base, sm90, &mut |s| {
        kinds.push(s.kind());
        run(&mut m, s);
        Ok(())
    })
    .unwrap();
    let sm90_steps = kinds.iter().filter(|k| k.ends_with("_sm90")).count();
    let gemms = 5 - usize::from(saved_gate_up);
    assert_eq!(sm90_steps, if sm90 { gemms } else { 0 }, "{kinds:?}");
    let r = moe_backward_f64(&p, &x, &d_out, 0.7, 0.3).unwrap();
    let mut checks = vec![
        ("dx", args.dx, &r.dx, h),
        ("d_router", args.d_router, &r.d_router, e),
        ("dw13", args.dw13, &r.dw13, 2 * i),
        ("dw2", args.dw2, &r.dw2, h),
    ];
    if let (Some(a), Some(b), Some(ra), Some(rb)) = (
        args.d_shared_w13,
        args.d_shared_w2,
        r.d_shared_w13.as_ref(),
        r.d_shared_w2.as_ref(),
    ) {
        checks.push(("d_shared_w13", a, ra, 2 * i));
        checks.push(("d_shared_w2", b, rb, h));
    }
    assert_eq!(checks.len(), if c.shared_expert { 6 } else { 4 });
    let tol = tolerance(dt).rel_l2;
    for (name, out, reference, row) in checks {
        let got = m.get_h(out.ptr, reference.len());
        let em = error_metrics_rows(&got, reference, row);
        assert_eq!(em.non_finite, 0, "{c:?}: {name} has non-finite values");
        assert!(
            em.rel_l2 <= tol && em.max_row_rel_l2 <= 4.0 * tol,
            "{c:?}: {name} rel L2 {:.3e}, worst row {:.3e} (tol {tol:.1e})",
            em.rel_l2,
            em.max_row_rel_l2
        );
    }
}

fn class() -> MoeClass {
    MoeClass {
        dtype: DType::Bf16,
        hidden: 64,
        intermediate: 32,
        experts: 4,
        top_k: 2,
        scoring: Scoring::Softmax,
        renormalize: true,
        shared_expert: false,
        max_tokens: 13,
    }
}

#[test]
fn launch_sequence_on_the_cpu_model_matches_f64_reference() {
    let b = class();
    for (n, c) in [
        MoeClass {
            shared_expert: true,
            ..b
        },
        MoeClass {
            scoring: Scoring::Sigmoid,
            renormalize: false,
            dtype: DType::F16,
            ..b
        },
        MoeClass {
            top_k: 4,
            max_tokens: 7,
            ..b
        },
        // two chunks of d_router's tokens (550 + 550)
        MoeClass {
            max_tokens: 1100,
            ..b
        },
    ]
    .into_iter()
    .enumerate()
    {
        for sm90 in [false, true] {
            for saved in [false, true] {
                model_case(c, 0x6d6f_6562 + n as u64, sm90, saved);
            }
        }
    }
}
