//! The sampling loop: warm-up by time, then implementations measured interleaved
//! round-robin (shuffled order each round) until every median's bootstrap CI is tight,
//! or a sample / time cap is hit. Backend-agnostic: each implementation supplies its own
//! timer (host clock on CPU, CUDA events on GPU) through [`Sampled::sample`].
//!
//! `bench --against` replaces the stop rule ([`ResolveRule`]): sampling goes on until the
//! speedup CI of every (old build, this build) pair *resolves* the practical band
//! [1/(1+t), 1+t] — lies entirely above it, entirely below it, or entirely inside it — so
//! the gate's verdict is decided by the data rather than by the time cap, up to a longer
//! cap of its own.

use crate::results::MeasureSettings;
use crate::stats;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Something that can be timed once.
pub trait Sampled {
    /// Run the timed region once and return its duration in milliseconds.
    fn sample(&mut self) -> anyhow::Result<f64>;
}

/// Environment variable of the test-only slowdown knob: `NAME:FRACTION` (e.g.
/// `cpu-tiled:10%`) makes the CPU implementation NAME spin for FRACTION of each sample's
/// own time inside its timed region. It exists only so `scripts/aa-calibration.sh` can
/// check that `compare` catches a real slowdown; a run with it set records it as a flag on
/// the slowed implementation.
pub const TEST_SLOWDOWN_ENV: &str = "FLASHMOE_TEST_SLOWDOWN";

/// The fraction [`TEST_SLOWDOWN_ENV`] asks for `name`, if any. A malformed value is an
/// error naming the problem.
pub fn test_slowdown(name: &str) -> anyhow::Result<Option<f64>> {
    match std::env::var(TEST_SLOWDOWN_ENV) {
        Ok(v) => parse_slowdown(&v, name),
        Err(_) => Ok(None),
    }
}

/// [`test_slowdown`] of the value `v`.
fn parse_slowdown(v: &str, name: &str) -> anyhow::Result<Option<f64>> {
    let Some((who, frac)) = v.rsplit_once(':') else {
        anyhow::bail!("{TEST_SLOWDOWN_ENV}={v}: expected NAME:FRACTION, e.g. cpu-tiled:10%");
    };
    let (num, scale) = match frac.strip_suffix('%') {
        Some(n) => (n, 0.01),
        None => (frac, 1.0),
    };
    match num.trim().parse::<f64>() {
        Ok(x) if (0.0..=10.0).contains(&(x * scale)) => Ok((who == name).then_some(x * scale)),
        _ => anyhow::bail!("{TEST_SLOWDOWN_ENV}={v}: '{frac}' is not a fraction between 0 and 10"),
    }
}

/// Busy-wait (test-only slowdown): keeps the core as busy as the work it stretches.
pub fn spin_for(seconds: f64) {
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < seconds {
        std::hint::spin_loop();
    }
}

pub use crate::results::StopReason;

/// Samples for one implementation, in measurement order.
#[derive(Debug, Clone, Default)]
pub struct SampleSet {
    pub samples_ms: Vec<f64>,
    /// First error raised by the implementation; it is not sampled after that.
    pub error: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Measurement {
    pub sets: Vec<SampleSet>,
    pub stop: StopReason,
    pub rounds: usize,
    /// Wall time of the sampling rounds (after warm-up), ms.
    pub sampling_ms: f64,
}

/// The stop rule of a `bench --against` run: pairs of implementations (the old build's
/// `old:X` as the baseline, this build's `X` as the candidate) whose speedup CI,
/// median(old) / median(new) at level 1 − `alpha`, must resolve the band
/// [1/(1+t), 1+t] of the practical threshold t (see [`resolves`]) before sampling stops.
///
/// With it, the usual stop (every median CI within `target_rel_ci`, or `max_time_ms`)
/// no longer ends sampling on its own: a noisy machine widens the CIs, and a gate that
/// stops at a fixed time then answers UNCLEAR where more rounds would have decided (issue
/// 32: a 10% slowdown caught in 13 of 20 runs under load at the 4 s cap). Sampling stops
/// when every pair resolved ([`StopReason::Resolved`]), or at `max_time_ms` of this rule
/// (≥ the settings' cap) or at the sample cap scaled by the same factor; a pair that is
/// still unresolved there is reported as such by the verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolveRule {
    /// (baseline index, candidate index) into the implementations measured.
    pub pairs: Vec<(usize, usize)>,
    /// Practical threshold t as a fraction (0.05 = 5%).
    pub threshold: f64,
    /// The CI is at level 1 − alpha, as in the verdict.
    pub alpha: f64,
    /// Sampling-time cap of an unresolved measurement, ms.
    pub max_time_ms: f64,
}

/// Whether the speedup interval `ci` resolves the band [1/(1+t), 1+t]: entirely below
/// it (the candidate slower by more than t), entirely above it (faster by more than t),
/// or entirely inside it (the same within t). An interval that straddles a band edge, or
/// has a NaN bound, does not.
pub fn resolves(ci: &stats::Interval, threshold: f64) -> bool {
    let upper = 1.0 + threshold;
    let lower = 1.0 / upper;
    ci.high < lower || ci.low > upper || (ci.low >= lower && ci.high <= upper)
}

impl Default for MeasureSettings {
    fn default() -> Self {
        MeasureSettings {
            warmup_ms: 200.0,
            target_rel_ci: 0.01,
            min_samples: 10,
            max_samples: 500,
            max_time_ms: 10_000.0,
            confidence: 0.95,
            bootstrap_resamples: 2000,
            seed: 0x5eed,
            threshold: 0.02,
            cache_policy: "none".into(),
            timer: "host clock".into(),
            against_max_time_ms: None,
        }
    }
}

/// Resamples used by the stopping rule (the final report uses the full count).
const STOP_RULE_RESAMPLES: usize = 500;

fn converged(set: &SampleSet, settings: &MeasureSettings, seed: u64) -> bool {
    if set.error.is_some() {
        return true; // nothing more to learn from a failed implementation
    }
    let n = set.samples_ms.len();
    if n < settings.min_samples.max(2) {
        return false;
    }
    let ci = stats::bootstrap_median_ci(
        &set.samples_ms,
        settings.confidence,
        STOP_RULE_RESAMPLES,
        seed,
    );
    ci.relative_half_width() <= settings.target_rel_ci
}

/// Whether every pair of `rule` resolved its band (a pair with a failed side has nothing
/// more to learn and counts as resolved).
///
/// The CI is computed exactly as the verdict computes it afterwards (the settings' seed and
/// resample count; `bench --against` passes the same to `compare_against_old`), so a pair
/// that stopped as resolved is reported as resolved.
fn pairs_resolved(sets: &[SampleSet], rule: &ResolveRule, settings: &MeasureSettings) -> bool {
    rule.pairs.iter().all(|&(base, cand)| {
        let (b, c) = (&sets[base], &sets[cand]);
        if b.error.is_some() || c.error.is_some() {
            return true;
        }
        let n = b.samples_ms.len().min(c.samples_ms.len());
        if n < settings.min_samples.max(2) {
            return false;
        }
        let ci = stats::bootstrap_speedup_ci(
            &b.samples_ms,
            &c.samples_ms,
            1.0 - rule.alpha,
            settings.bootstrap_resamples,
            settings.seed,
        );
        resolves(&ci, rule.threshold)
    })
}

/// Measure `impls` interleaved. `cancel` is polled between samples; `on_round` is called
/// after each round with the number of rounds done (for progress display).
pub fn measure_interleaved(
    impls: &mut [&mut dyn Sampled],
    settings: &MeasureSettings,
    cancel: &AtomicBool,
    on_round: impl FnMut(usize),
) -> Measurement {
    measure_interleaved_until(impls, settings, None, cancel, on_round)
}

/// [`measure_interleaved`] with an optional [`ResolveRule`] (`bench --against`) in place
/// of the usual stop rule.
pub fn measure_interleaved_until(
    impls: &mut [&mut dyn Sampled],
    settings: &MeasureSettings,
    resolve: Option<&ResolveRule>,
    cancel: &AtomicBool,
    mut on_round: impl FnMut(usize),
) -> Measurement {
    // Caps: the rule's time cap (never below the settings' one) and the sample cap scaled
    // by the same factor.
    let resolve = resolve.filter(|r| !r.pairs.is_empty());
    let (max_time_ms, max_rounds) = match resolve {
        Some(r) => {
            let t = r.max_time_ms.max(settings.max_time_ms);
            let factor = if settings.max_time_ms > 0.0 {
                (t / settings.max_time_ms).ceil().max(1.0)
            } else {
                1.0
            };
            (t, (settings.max_samples as f64 * factor) as usize)
        }
        None => (settings.max_time_ms, settings.max_samples),
    };
    let k = impls.len();
    let mut sets = vec![SampleSet::default(); k];
    let start = Instant::now();
    let elapsed_ms = |start: &Instant| start.elapsed().as_secs_f64() * 1e3;

    // Warm-up by time, each implementation in turn (at least one call each), so compile,
    // module load, allocation and clock ramp-up stay out of the samples.
    for (i, imp) in impls.iter_mut().enumerate() {
        let t0 = Instant::now();
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Measurement {
                    sets,
                    stop: StopReason::Cancelled,
                    rounds: 0,
                    sampling_ms: 0.0,
                };
            }
            if let Err(e) = imp.sample() {
                sets[i].error = Some(format!("{e:#}"));
                break;
            }
            if elapsed_ms(&t0) >= settings.warmup_ms {
                break;
            }
        }
    }

    let sampling_start = Instant::now();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(settings.seed);
    let mut order: Vec<usize> = (0..k).collect();
    let mut rounds = 0;
    let mut next_check = settings.min_samples.max(2);
    let stop = loop {
        if cancel.load(Ordering::Relaxed) {
            break StopReason::Cancelled;
        }
        if sets.iter().all(|s| s.error.is_some()) {
            break StopReason::Converged;
        }
        order.shuffle(&mut rng);
        for &i in &order {
            if sets[i].error.is_some() {
                continue;
            }
            match impls[i].sample() {
                Ok(ms) if ms.is_finite() && ms >= 0.0 => sets[i].samples_ms.push(ms),
                Ok(ms) => sets[i].error = Some(format!("timer returned an invalid time {ms}")),
                Err(e) => sets[i].error = Some(format!("{e:#}")),
            }
        }
        rounds += 1;
        on_round(rounds);
        if rounds >= max_rounds {
            break StopReason::SampleCap;
        }
        // At least two rounds: one sample has no spread, and compare needs two a side.
        if rounds >= 2 && elapsed_ms(&sampling_start) >= max_time_ms {
            break StopReason::TimeCap;
        }
        // Check convergence at geometrically spaced rounds: the bootstrap is not free.
        if rounds >= next_check {
            next_check = rounds + (rounds / 8).max(5);
            let seed = settings.seed ^ rounds as u64;
            match resolve {
                Some(rule) => {
                    if pairs_resolved(&sets, rule, settings) {
                        break StopReason::Resolved;
                    }
                }
                None => {
                    if sets.iter().all(|s| converged(s, settings, seed)) {
                        break StopReason::Converged;
                    }
                }
            }
        }
    };
    let _ = start;
    Measurement {
        sets,
        stop,
        rounds,
        sampling_ms: elapsed_ms(&sampling_start),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// A fake implementation whose "time" is drawn from a distribution; it also records
    /// the global call order so interleaving can be checked.
    struct Fake {
        id: usize,
        base: f64,
        noise: f64,
        rng: rand_chacha::ChaCha8Rng,
        log: std::rc::Rc<std::cell::RefCell<Vec<usize>>>,
        fail_after: Option<usize>,
        calls: usize,
    }

    impl Sampled for Fake {
        fn sample(&mut self) -> anyhow::Result<f64> {
            self.calls += 1;
            if let Some(n) = self.fail_after {
                if self.calls > n {
                    anyhow::bail!("device lost");
                }
            }
            self.log.borrow_mut().push(self.id);
            Ok(self.base * (1.0 + self.noise * self.rng.gen_range(-1.0..1.0)))
        }
    }

    fn fake(
        id: usize,
        base: f64,
        noise: f64,
        log: &std::rc::Rc<std::cell::RefCell<Vec<usize>>>,
    ) -> Fake {
        Fake {
            id,
            base,
            noise,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(id as u64 + 1),
            log: log.clone(),
            fail_after: None,
            calls: 0,
        }
    }

    fn quick_settings() -> MeasureSettings {
        MeasureSettings {
            warmup_ms: 0.0,
            min_samples: 10,
            max_samples: 300,
            max_time_ms: 5_000.0,
            ..MeasureSettings::default()
        }
    }

    #[test]
    fn interleaves_every_round_and_converges_on_tight_noise() {
        let log = Default::default();
        let mut a = fake(0, 1.0, 0.001, &log);
        let mut b = fake(1, 2.0, 0.001, &log);
        let cancel = AtomicBool::new(false);
        let m = measure_interleaved(&mut [&mut a, &mut b], &quick_settings(), &cancel, |_| {});
        assert_eq!(m.stop, StopReason::Converged);
        assert_eq!(m.sets[0].samples_ms.len(), m.rounds);
        assert_eq!(m.sets[1].samples_ms.len(), m.rounds);
        // After warm-up (one call each), every round holds each implementation once.
        let calls = log.borrow();
        for round in calls[2..].chunks(2) {
            let mut r = round.to_vec();
            r.sort();
            assert_eq!(r, vec![0, 1]);
        }
        // The order is shuffled, not fixed.
        let firsts: std::collections::HashSet<usize> = calls[2..].chunks(2).map(|r| r[0]).collect();
        assert_eq!(firsts.len(), 2);
    }

    #[test]
    fn noisy_samples_hit_the_sample_cap() {
        let log = Default::default();
        let mut a = fake(0, 1.0, 0.9, &log);
        let cancel = AtomicBool::new(false);
        let s = MeasureSettings {
            max_samples: 40,
            target_rel_ci: 0.0001,
            ..quick_settings()
        };
        let m = measure_interleaved(&mut [&mut a], &s, &cancel, |_| {});
        assert_eq!(m.stop, StopReason::SampleCap);
        assert_eq!(m.sets[0].samples_ms.len(), 40);
    }

    #[test]
    fn a_failing_implementation_is_recorded_and_the_others_go_on() {
        let log = Default::default();
        let mut a = fake(0, 1.0, 0.001, &log);
        let mut b = fake(1, 1.0, 0.001, &log);
        b.fail_after = Some(5);
        let cancel = AtomicBool::new(false);
        let m = measure_interleaved(&mut [&mut a, &mut b], &quick_settings(), &cancel, |_| {});
        assert!(m.sets[1].error.as_deref().unwrap().contains("device lost"));
        assert!(m.sets[0].samples_ms.len() >= 10);
        assert!(m.sets[1].samples_ms.len() <= 5);
    }

    #[test]
    fn test_slowdown_knob_parses_and_rejects() {
        assert_eq!(
            parse_slowdown("cpu-tiled:10%", "cpu-tiled").unwrap(),
            Some(0.1)
        );
        assert_eq!(
            parse_slowdown("cpu-tiled:10%", "cpu-reference").unwrap(),
            None
        );
        assert_eq!(
            parse_slowdown("cpu-tiled:0.25", "cpu-tiled").unwrap(),
            Some(0.25)
        );
        assert!(parse_slowdown("cpu-tiled", "cpu-tiled").is_err());
        assert!(parse_slowdown("cpu-tiled:lots", "x").is_err());
        assert!(parse_slowdown("cpu-tiled:-5%", "cpu-tiled").is_err());
        let t0 = Instant::now();
        spin_for(0.002);
        assert!(t0.elapsed().as_secs_f64() >= 0.002);
    }

    #[test]
    fn resolves_needs_the_ci_on_one_side_of_each_band_edge() {
        let ci = |low: f64, high: f64| stats::Interval {
            estimate: (low + high) / 2.0,
            low,
            high,
            level: 0.95,
        };
        let t = 0.05; // band [0.952, 1.05]
        assert!(resolves(&ci(0.98, 1.02), t)); // inside: SAME
        assert!(resolves(&ci(0.85, 0.94), t)); // below: slower by more than t
        assert!(resolves(&ci(1.06, 1.2), t)); // above: faster by more than t
        assert!(!resolves(&ci(0.9, 0.97), t)); // straddles the lower edge
        assert!(!resolves(&ci(1.02, 1.08), t)); // straddles the upper edge
        assert!(!resolves(&ci(0.9, 1.1), t)); // wider than the band
        assert!(!resolves(&ci(f64::NAN, 1.0), t));
    }

    #[test]
    fn against_rule_stops_when_the_pair_resolves() {
        // A 10% slowdown with 2% noise: the ratio CI leaves the ±5% band quickly, and
        // sampling stops there although the median CIs (target 0.01%) never converge.
        let log = Default::default();
        let mut old = fake(0, 1.0, 0.02, &log);
        let mut new = fake(1, 1.1, 0.02, &log);
        let cancel = AtomicBool::new(false);
        let s = MeasureSettings {
            target_rel_ci: 0.0001,
            ..quick_settings()
        };
        let rule = ResolveRule {
            pairs: vec![(0, 1)],
            threshold: 0.05,
            alpha: 0.05,
            max_time_ms: 60_000.0,
        };
        let m =
            measure_interleaved_until(&mut [&mut old, &mut new], &s, Some(&rule), &cancel, |_| {});
        assert_eq!(m.stop, StopReason::Resolved);
        assert!(m.rounds < 100, "{} rounds", m.rounds);
        // Without the rule the same samples run to the sample cap.
        let mut old = fake(0, 1.0, 0.02, &log);
        let mut new = fake(1, 1.1, 0.02, &log);
        let m = measure_interleaved(&mut [&mut old, &mut new], &s, &cancel, |_| {});
        assert_eq!(m.stop, StopReason::SampleCap);
    }

    #[test]
    fn against_rule_samples_past_the_usual_caps_then_gives_up() {
        // True ratio on the band edge (5.0% slower): the CI straddles 1/1.05 for ever.
        // The usual stop (median CIs within 1% with 0.1% noise) would stop early; the rule
        // goes on to its own cap, the sample cap times max_time / settings.max_time.
        let log = Default::default();
        let mut old = fake(0, 1.0, 0.001, &log);
        let mut new = fake(1, 1.05, 0.001, &log);
        let cancel = AtomicBool::new(false);
        let s = MeasureSettings {
            max_samples: 40,
            max_time_ms: 1_000.0,
            ..quick_settings()
        };
        let rule = ResolveRule {
            pairs: vec![(0, 1)],
            threshold: 0.05,
            alpha: 0.05,
            max_time_ms: 3_000.0,
        };
        let m =
            measure_interleaved_until(&mut [&mut old, &mut new], &s, Some(&rule), &cancel, |_| {});
        assert_eq!(m.stop, StopReason::SampleCap);
        assert_eq!(m.rounds, 120);
        // An empty rule is no rule.
        let empty = ResolveRule {
            pairs: vec![],
            ..rule
        };
        let m =
            measure_interleaved_until(&mut [&mut old, &mut new], &s, Some(&empty), &cancel, |_| {});
        assert_eq!(m.stop, StopReason::Converged);
    }

    #[test]
    fn cancel_stops_sampling() {
        let log = Default::default();
        let mut a = fake(0, 1.0, 0.5, &log);
        let cancel = AtomicBool::new(false);
        let m = measure_interleaved(&mut [&mut a], &quick_settings(), &cancel, |r| {
            if r == 3 {
                cancel.store(true, Ordering::Relaxed);
            }
        });
        assert_eq!(m.stop, StopReason::Cancelled);
        assert_eq!(m.rounds, 3);
    }
}
