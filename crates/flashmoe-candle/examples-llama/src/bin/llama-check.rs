//! candle-transformers' Llama, unmodified, with `use_flash_attn = true` (its
//! `candle_flash_attn::flash_attn` calls, which this project patches to flashmoe-candle)
//! against the same model with `use_flash_attn = false` (candle's own attention, in f32).
//!
//! Per head dim: random weights (fixed seed) shared by three models — bf16 on flashmoe,
//! bf16 on candle's attention, and f32 on candle's attention (the reference). A batch of
//! random prompts runs a causal prefill (last-row logits), then decode steps through
//! llama.rs's KV cache (Sq = 1 against the whole cache). Every step's logits are compared
//! per batch row.
//!
//! Tolerance: the two bf16 models differ in attention rounding only. flashmoe rounds at two
//! points (the softmax probabilities to bf16 for the P·V product, and the output), candle at
//! one (it computes the whole attention in f32 and rounds the output); both round every
//! linear layer's output to bf16. So flashmoe passes when it is about as close to the f32
//! model as candle's own bf16 model is: per row, rel_l2(flashmoe, f32) <=
//! 2 · rel_l2(candle bf16, f32) + 1e-3 (2: the second rounding point can at most double the
//! attention's share of the error). A wrong mask, stride or head mapping gives errors of
//! order one, far above it. NaN or Inf never passes. Exit code: 0 all pass, 1 a check
//! failed, 2 an error.
//!
//! Usage: llama-check [--head-dims 128,64,96,80] [--prompt 333] [--decode 8] [--batch 2]
//!                    [--layers 4] [--seed N]

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Config, Llama};
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const VOCAB: usize = 32000;
/// rel_l2(flashmoe, f32) <= RATIO · rel_l2(candle bf16, f32) + FLOOR (see the module doc).
const RATIO: f64 = 2.0;
const FLOOR: f64 = 1e-3;

struct Args {
    head_dims: Vec<usize>,
    prompt: usize,
    decode: usize,
    batch: usize,
    layers: usize,
    seed: u64,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        head_dims: vec![128, 64, 96, 80],
        prompt: 333,
        decode: 8,
        batch: 2,
        layers: 4,
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| {
            v.parse::<u64>()
                .map_err(|e| format!("{flag}: '{v}' is not a number ({e})"))
        };
        match flag.as_str() {
            "--head-dims" => {
                a.head_dims = value
                    .split(',')
                    .map(|v| num(v).map(|x| x as usize))
                    .collect::<std::result::Result<_, _>>()?
            }
            "--prompt" => a.prompt = num(&value)? as usize,
            "--decode" => a.decode = num(&value)? as usize,
            "--batch" => a.batch = num(&value)? as usize,
            "--layers" => a.layers = num(&value)? as usize,
            "--seed" => a.seed = num(&value)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.prompt < 2 || a.batch == 0 || a.layers == 0 || a.head_dims.is_empty() {
        return Err("need --prompt >= 2, --batch >= 1, --layers >= 1, a head dim".into());
    }
    if a.head_dims.iter().any(|&d| d == 0 || d % 8 != 0 || d > 256) {
        return Err("head dims must be multiples of 8 up to 256".into());
    }
    if a.prompt + a.decode > 4096 {
        return Err("prompt + decode must fit llama.rs's 4096 positions".into());
    }
    Ok(a)
}

/// xorshift64*: uniform draws for weights and tokens, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// f32 tensor of the given shape, uniform with standard deviation `std` around `mean`.
fn uniform(rng: &mut Rng, shape: &[usize], mean: f32, std: f32, dev: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let half_width = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n).map(|_| mean + half_width * rng.unit()).collect();
    Tensor::from_vec(data, shape, dev)
}

fn config(head_dim: usize, layers: usize, use_flash_attn: bool) -> Config {
    let hidden = HEADS * head_dim;
    Config {
        hidden_size: hidden,
        // Llama's 8/3 · hidden, rounded up to a multiple of 256.
        intermediate_size: (8 * hidden / 3).div_ceil(256) * 256,
        vocab_size: VOCAB,
        num_hidden_layers: layers,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        use_flash_attn,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: candle_transformers::models::llama::DEFAULT_MAX_SEQ_LEN,
        tie_word_embeddings: false,
    }
}

/// Every tensor llama.rs loads, f32 on `dev`. q/k projections are scaled so that the
/// attention scores have a standard deviation of about 3 (sharp, position-dependent
/// softmax rows, so a mask or layout error changes the output); the rest keep activations
/// of order one.
fn weights(cfg: &Config, seed: u64, dev: &Device) -> Result<HashMap<String, Tensor>> {
    let mut rng = Rng::new(seed);
    let h = cfg.hidden_size;
    let d = h / cfg.num_attention_heads;
    let (q, kv, i) = (
        cfg.num_attention_heads * d,
        cfg.num_key_value_heads * d,
        cfg.intermediate_size,
    );
    let mut m = HashMap::new();
    let mut put = |name: String, shape: &[usize], mean: f32, std: f32| -> Result<()> {
        m.insert(name, uniform(&mut rng, shape, mean, std, dev)?);
        Ok(())
    };
    let fan = |n: usize| 1.0 / (n as f32).sqrt();
    // x after RMSNorm has rms 1, so q_i has std sigma·sqrt(h) and q·k/sqrt(d) std sigma²·h.
    let qk = (3.0 / h as f32).sqrt();
    put(
        "model.embed_tokens.weight".into(),
        &[cfg.vocab_size, h],
        0.0,
        1.0,
    )?;
    put("lm_head.weight".into(), &[cfg.vocab_size, h], 0.0, fan(h))?;
    put("model.norm.weight".into(), &[h], 1.0, 0.1)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        put(format!("{p}.input_layernorm.weight"), &[h], 1.0, 0.1)?;
        put(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            1.0,
            0.1,
        )?;
        put(format!("{p}.self_attn.q_proj.weight"), &[q, h], 0.0, qk)?;
        put(format!("{p}.self_attn.k_proj.weight"), &[kv, h], 0.0, qk)?;
        put(
            format!("{p}.self_attn.v_proj.weight"),
            &[kv, h],
            0.0,
            fan(h),
        )?;
        put(format!("{p}.self_attn.o_proj.weight"), &[h, q], 0.0, fan(q))?;
        put(format!("{p}.mlp.gate_proj.weight"), &[i, h], 0.0, fan(h))?;
        put(format!("{p}.mlp.up_proj.weight"), &[i, h], 0.0, fan(h))?;
        put(format!("{p}.mlp.down_proj.weight"), &[h, i], 0.0, fan(i))?;
    }
    Ok(m)
}

/// One model and its KV cache.
struct Run {
    model: Llama,
    cache: Cache,
}

impl Run {
    fn new(w: &HashMap<String, Tensor>, cfg: &Config, dtype: DType, dev: &Device) -> Result<Self> {
        let vb = VarBuilder::from_tensors(w.clone(), dtype, dev);
        Ok(Run {
            model: Llama::load(vb, cfg)?,
            cache: Cache::new(true, dtype, cfg, dev)?,
        })
    }

    /// Logits (batch, vocab) as f32 rows on the host.
    fn step(&mut self, tokens: &Tensor, index_pos: usize) -> Result<Vec<Vec<f32>>> {
        self.model
            .forward(tokens, index_pos, &mut self.cache)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn max_abs(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max)
}

fn argmax(a: &[f32]) -> usize {
    a.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |m, (i, &x)| if x > m.1 { (i, x) } else { m },
        )
        .0
}

/// Checks one head dim; returns the number of failed rows.
fn check_head_dim(a: &Args, head_dim: usize, dev: &Device) -> Result<usize> {
    let seed = a.seed ^ head_dim as u64;
    let cfg_flash = config(head_dim, a.layers, true);
    let cfg_candle = config(head_dim, a.layers, false);
    println!(
        "== head dim {head_dim}: hidden {}, heads {HEADS}/{KV_HEADS} (GQA), layers {}, \
         intermediate {}, vocab {VOCAB}; batch {}, prompt {}, decode {}; seed {seed}",
        cfg_flash.hidden_size, a.layers, cfg_flash.intermediate_size, a.batch, a.prompt, a.decode
    );
    let w = weights(&cfg_flash, seed, dev)?;
    let mut flash = Run::new(&w, &cfg_flash, DType::BF16, dev)?;
    let mut candle = Run::new(&w, &cfg_candle, DType::BF16, dev)?;
    let mut exact = Run::new(&w, &cfg_candle, DType::F32, dev)?;
    drop(w);

    let mut rng = Rng::new(seed ^ 0x70_6b_65_6e);
    let mut tokens = |len: usize| -> Result<Tensor> {
        let t: Vec<u32> = (0..a.batch * len)
            .map(|_| (rng.next() % VOCAB as u64) as u32)
            .collect();
        Tensor::from_vec(t, (a.batch, len), dev)
    };
    let mut failed = 0;
    let mut worst = (0f64, 0f64);
    let mut index_pos = 0;
    for step in 0..=a.decode {
        let len = if step == 0 { a.prompt } else { 1 };
        let input = tokens(len)?;
        let t0 = Instant::now();
        let lf = flash.step(&input, index_pos)?;
        let t_flash = t0.elapsed();
        let t0 = Instant::now();
        let lc = candle.step(&input, index_pos)?;
        let t_candle = t0.elapsed();
        let le = exact.step(&input, index_pos)?;
        index_pos += len;
        let what = if step == 0 {
            format!("prefill Sq={len}")
        } else {
            format!("decode {step} Sq=1 Sk={index_pos}")
        };
        for b in 0..a.batch {
            let (f, c, e) = (&lf[b], &lc[b], &le[b]);
            let finite = f.iter().all(|x| x.is_finite());
            let fe = rel_l2(f, e);
            let ce = rel_l2(c, e);
            let bound = RATIO * ce + FLOOR;
            let ok = finite && c.iter().all(|x| x.is_finite()) && fe <= bound;
            if !ok {
                failed += 1;
            }
            worst = (worst.0.max(fe), worst.1.max(ce));
            println!(
                "{what:<24} row {b}: flashmoe vs candle bf16: rel_l2 {:.3e} max_abs {:.3e} \
                 top1 {}; vs f32: flashmoe {fe:.3e}, candle bf16 {ce:.3e} (bound {bound:.3e}) \
                 {} [{:.1} ms / {:.1} ms]",
                rel_l2(f, c),
                max_abs(f, c),
                if argmax(f) == argmax(c) {
                    "same"
                } else {
                    "differs"
                },
                if ok {
                    "ok"
                } else if finite {
                    "FAIL"
                } else {
                    "FAIL (non-finite)"
                },
                t_flash.as_secs_f64() * 1e3,
                t_candle.as_secs_f64() * 1e3,
            );
        }
    }
    println!(
        "head dim {head_dim}: {} (worst rel_l2 vs f32: flashmoe {:.3e}, candle bf16 {:.3e})",
        if failed == 0 {
            "PASS".to_string()
        } else {
            format!("FAIL ({failed} rows)")
        },
        worst.0,
        worst.1
    );
    Ok(failed)
}

fn main() -> ExitCode {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("llama-check: {e}");
            return ExitCode::from(2);
        }
    };
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("llama-check: no CUDA device: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "llama-check: candle-transformers llama.rs, use_flash_attn=true (flashmoe-candle via \
         the candle-flash-attn shim) vs false (candle's attention); seed {}",
        a.seed
    );
    let mut failed_dims = Vec::new();
    for &d in &a.head_dims {
        match check_head_dim(&a, d, &dev) {
            Ok(0) => {}
            Ok(_) => failed_dims.push(d),
            Err(e) => {
                eprintln!("llama-check: head dim {d}: error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    if failed_dims.is_empty() {
        println!("llama-check: PASS (head dims {:?})", a.head_dims);
        ExitCode::SUCCESS
    } else {
        println!("llama-check: FAIL (head dims {failed_dims:?})");
        ExitCode::from(1)
    }
}
