//! `flashmoe serve`: this build's implementations offered over the worker protocol (JSON
//! lines on stdin/stdout, the protocol `python/flashmoe_worker.py` speaks; see
//! docs/baselines.md), so that a newer build can time them interleaved with its own in one
//! run (`flashmoe bench --against OLD_BINARY`, client side in [`super::python`]).
//!
//! Timing happens here, in the serving process, with this build's own timer (host clock on
//! CPU, flush + CUDA events on GPU): one `sample` request is one timed call, and the pipe
//! round trip is outside the timed region. Inputs are generated here from the problem and
//! seed, and their checksum is returned so the client can refuse a mismatch.
//!
//! Handles borrow the inputs of one (problem, seed); the client prepares every
//! implementation of a config, samples them, and releases them before the next config, so
//! the server keeps one set of inputs at a time: a `prepare` for another problem drops the
//! handles of the previous one.

use super::pipeline::generated_inputs_checksum;
use super::{Implementation, Outputs, Prepared, SuiteInputs};
use crate::results::ProblemSpec;
use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

/// Who is serving, for the hello.
pub struct ServeInfo {
    /// "cpu" or "cuda".
    pub device: String,
    /// The timer the samples use.
    pub timer: String,
    /// The GPU's name, if any.
    pub gpu_name: Option<String>,
}

/// One parsed request.
struct Request {
    id: Value,
    op: String,
    body: Value,
}

fn read_request(line: &str) -> Result<Request, String> {
    let v: Value = serde_json::from_str(line.trim()).map_err(|e| format!("not JSON: {e}"))?;
    let op = v
        .get("op")
        .and_then(Value::as_str)
        .ok_or("no 'op'")?
        .to_string();
    Ok(Request {
        id: v.get("id").cloned().unwrap_or(Value::Null),
        op,
        body: v,
    })
}

fn reply(out: &mut impl Write, id: &Value, mut fields: Value) -> std::io::Result<()> {
    fields["id"] = id.clone();
    fields["ok"] = json!(true);
    writeln!(out, "{fields}")?;
    out.flush()
}

fn reply_error(out: &mut impl Write, id: &Value, kind: &str, why: &str) -> std::io::Result<()> {
    writeln!(
        out,
        "{}",
        json!({ "id": id, "ok": false, "kind": kind, "error": why })
    )?;
    out.flush()
}

/// Serve `implementations` until `quit` or end of input. Errors of one request are replied
/// (`kind` "na" for unsupported configs, "error" otherwise) and serving goes on; only I/O
/// failures end it with `Err`.
pub fn serve(
    implementations: &[Box<dyn Implementation>],
    info: &ServeInfo,
    input: impl BufRead,
    mut output: impl Write,
) -> anyhow::Result<()> {
    let names: Vec<&str> = implementations.iter().map(|i| i.name()).collect();
    let hello = json!({
        "protocol": super::python::PROTOCOL_VERSION,
        "ok": true,
        "versions": { "flashmoe": env!("CARGO_PKG_VERSION") },
        "gpu": info.gpu_name.as_ref().map(|n| json!({ "name": n })),
        "device": info.device,
        "timer": info.timer,
        "implementations": names,
        "pid": std::process::id(),
    });
    writeln!(output, "{hello}")?;
    output.flush()?;
    let mut lines = input.lines();
    let mut pending: Option<Request> = None;
    // Handles are never reused, so a stale one can never name another problem's.
    let mut next_handle = 1u64;
    loop {
        let req = match pending.take() {
            Some(r) => r,
            None => match lines.next() {
                None => return Ok(()),
                Some(line) => match read_request(&line?) {
                    Ok(r) => r,
                    Err(why) => {
                        reply_error(&mut output, &Value::Null, "protocol", &why)?;
                        continue;
                    }
                },
            },
        };
        match req.op.as_str() {
            "quit" => return Ok(()),
            "prepare" => {
                let parsed = (|| -> anyhow::Result<(ProblemSpec, u64)> {
                    let problem: ProblemSpec = serde_json::from_value(
                        req.body.get("problem").cloned().unwrap_or_default(),
                    )
                    .context("the request's 'problem'")?;
                    let seed = req
                        .body
                        .get("seed")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| anyhow!("no 'seed'"))?;
                    Ok((problem, seed))
                })();
                match parsed {
                    Ok((problem, seed)) => {
                        let inputs = SuiteInputs::generate(&problem, seed);
                        pending = serve_problem(
                            implementations,
                            (&problem, seed),
                            &inputs,
                            req,
                            &mut next_handle,
                            &mut lines,
                            &mut output,
                        )?;
                    }
                    Err(e) => reply_error(&mut output, &req.id, "error", &format!("{e:#}"))?,
                }
            }
            // No handles outside a problem; configure has nothing to set here.
            "hello" => reply(&mut output, &req.id, json!({ "implementations": names }))?,
            "configure" | "release" => reply(&mut output, &req.id, json!({}))?,
            other => reply_error(
                &mut output,
                &req.id,
                "error",
                &format!("no handle or unknown op '{other}'"),
            )?,
        }
    }
}

/// Serve requests on the inputs of one (problem, seed), starting with the `prepare` in
/// `first`. Returns the first request that needs other inputs (a `prepare` of another
/// problem), or `None` at quit / end of input.
fn serve_problem<L: Iterator<Item = std::io::Result<String>>>(
    implementations: &[Box<dyn Implementation>],
    (problem, seed): (&ProblemSpec, u64),
    inputs: &SuiteInputs,
    first: Request,
    next_handle: &mut u64,
    lines: &mut L,
    output: &mut impl Write,
) -> anyhow::Result<Option<Request>> {
    let checksum = generated_inputs_checksum(problem, seed, inputs);
    let mut handles: BTreeMap<u64, Box<dyn Prepared + '_>> = BTreeMap::new();
    let mut req = first;
    loop {
        match req.op.as_str() {
            "quit" => return Ok(None),
            "prepare" => {
                let same = req.body.get("problem").cloned() == Some(serde_json::to_value(problem)?)
                    && req.body.get("seed").and_then(Value::as_u64) == Some(seed);
                if !same {
                    return Ok(Some(req));
                }
                let name = req.body.get("impl").and_then(Value::as_str).unwrap_or("");
                match implementations.iter().find(|i| i.name() == name) {
                    None => reply_error(
                        output,
                        &req.id,
                        "na",
                        &format!("this build has no implementation '{name}'"),
                    )?,
                    Some(imp) => match imp.supports(problem) {
                        Err(why) => reply_error(output, &req.id, "na", &why)?,
                        Ok(()) => match imp
                            .prepare(problem, inputs)
                            .and_then(|p| scaled_for_test(imp.as_ref(), p))
                        {
                            Err(e) => reply_error(output, &req.id, "error", &format!("{e:#}"))?,
                            Ok(p) => {
                                let h = *next_handle;
                                *next_handle += 1;
                                reply(
                                    output,
                                    &req.id,
                                    json!({
                                        "handle": h,
                                        "input_checksum": checksum,
                                        "ceiling_only": p.ceiling_only(),
                                        "notes": p.notes(),
                                    }),
                                )?;
                                handles.insert(h, p);
                            }
                        },
                    },
                }
            }
            op @ ("sample" | "run_for_check" | "release") => {
                let h = req.body.get("handle").and_then(Value::as_u64);
                match h.and_then(|h| handles.get_mut(&h).map(|p| (h, p))) {
                    None => reply_error(output, &req.id, "error", "unknown handle")?,
                    Some((h, p)) => match op {
                        "release" => {
                            handles.remove(&h);
                            reply(output, &req.id, json!({}))?;
                        }
                        "sample" => {
                            let n = req.body.get("n").and_then(Value::as_u64).unwrap_or(1);
                            let ms: anyhow::Result<Vec<f64>> = (0..n).map(|_| p.sample()).collect();
                            match ms {
                                Ok(ms) => reply(output, &req.id, json!({ "ms": ms }))?,
                                Err(e) => reply_error(output, &req.id, "error", &format!("{e:#}"))?,
                            }
                        }
                        _ => {
                            let dir = req.body.get("dir").and_then(Value::as_str).unwrap_or("");
                            match p
                                .run_for_check()
                                .and_then(|o| write_outputs(&o, Path::new(dir), h))
                            {
                                Ok(mut v) => {
                                    v["peak_extra_bytes"] = json!(p.peak_extra_bytes());
                                    v["notes"] = json!(p.notes());
                                    reply(output, &req.id, v)?
                                }
                                Err(e) => reply_error(output, &req.id, "error", &format!("{e:#}"))?,
                            }
                        }
                    },
                }
            }
            "configure" => reply(output, &req.id, json!({}))?,
            other => reply_error(output, &req.id, "error", &format!("unknown op '{other}'"))?,
        }
        req = loop {
            match lines.next() {
                None => return Ok(None),
                Some(line) => match read_request(&line?) {
                    Ok(r) => break r,
                    Err(why) => reply_error(output, &Value::Null, "protocol", &why)?,
                },
            }
        };
    }
}

/// The test-only slowdown knob ([`crate::measure::TEST_SLOWDOWN_ENV`]) for an
/// implementation whose timer the host cannot lengthen (CUDA events time the GPU, not the
/// host): its reported times are multiplied by 1 + FRACTION, a slowdown of exactly that
/// fraction in every sample, median included. CPU implementations spin inside their own
/// timed region instead (runner/cpu.rs) and are returned as they are. This is what lets
/// `scripts/aa-calibration.py --gpu` inject a slowdown into a GPU `bench --against` run
/// (the knob reaches only this build's `serve` child, never the old build's).
fn scaled_for_test<'a>(
    imp: &dyn Implementation,
    p: Box<dyn Prepared + 'a>,
) -> anyhow::Result<Box<dyn Prepared + 'a>> {
    if imp.backend() == "cpu" {
        return Ok(p);
    }
    Ok(match crate::measure::test_slowdown(imp.name())? {
        Some(f) => Box::new(ScaledForTest {
            inner: p,
            factor: f,
        }),
        None => p,
    })
}

/// See [`scaled_for_test`].
struct ScaledForTest<'a> {
    inner: Box<dyn Prepared + 'a>,
    factor: f64,
}

impl crate::measure::Sampled for ScaledForTest<'_> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        Ok(self.inner.sample()? * (1.0 + self.factor))
    }
}

impl Prepared for ScaledForTest<'_> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        self.inner.run_for_check()
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        self.inner.peak_extra_bytes()
    }
    fn ceiling_only(&self) -> bool {
        self.inner.ceiling_only()
    }
    fn router_ms(&self) -> Option<f64> {
        self.inner.router_ms()
    }
    fn notes(&self) -> Vec<String> {
        let mut n = self.inner.notes();
        n.push(format!(
            "TEST KNOB: {} scaled this implementation's reported times by {:.2} (its timer is \
             not the host clock)",
            crate::measure::TEST_SLOWDOWN_ENV,
            1.0 + self.factor
        ));
        n
    }
}

/// Outputs as little-endian files in `dir` (the worker protocol's `files` reply).
fn write_outputs(out: &Outputs, dir: &Path, handle: u64) -> anyhow::Result<Value> {
    if !dir.is_dir() {
        bail!("'{}' is not a directory", dir.display());
    }
    let write = |name: &str, bytes: Vec<u8>, len: usize| -> anyhow::Result<(String, Value)> {
        let path = dir.join(format!("h{handle}_{name}.bin"));
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        Ok((
            name.to_string(),
            json!({ "path": path.to_string_lossy(), "len": len }),
        ))
    };
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut files = serde_json::Map::new();
    let mut extra = json!({});
    match out {
        Outputs::Attention { o, lse } => {
            let (k, v) = write("o", f32s(o), o.len())?;
            files.insert(k, v);
            if !lse.is_empty() {
                let (k, v) = write("lse", f32s(lse), lse.len())?;
                files.insert(k, v);
            }
        }
        Outputs::Moe {
            out,
            topk_ids,
            losses,
        } => {
            let (k, v) = write("out", f32s(out), out.len())?;
            files.insert(k, v);
            if let Some(ids) = topk_ids {
                let bytes = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
                let (k, v) = write("topk_ids", bytes, ids.len())?;
                files.insert(k, v);
            }
            if let Some((aux, z)) = losses {
                extra["losses"] = json!([aux, z]);
            }
        }
        // One file per gradient, named as the client reads them (`GradProblem::tensors`).
        Outputs::Gradients(grads) => {
            for g in grads {
                let (k, v) = write(&g.name, f32s(&g.values), g.values.len())?;
                files.insert(k, v);
            }
        }
    }
    extra["files"] = Value::Object(files);
    Ok(extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::cpu::CpuImplementation;
    use flashmoe::{AttentionProblem, DType};

    fn run_session(requests: &[Value]) -> Vec<Value> {
        let imps: Vec<Box<dyn Implementation>> = vec![Box::new(CpuImplementation::tiled())];
        let info = ServeInfo {
            device: "cpu".into(),
            timer: "host clock".into(),
            gpu_name: None,
        };
        let input: String = requests.iter().map(|r| format!("{r}\n")).collect();
        let mut out = Vec::new();
        serve(&imps, &info, input.as_bytes(), &mut out).unwrap();
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn serves_prepare_sample_check_release_and_switches_problems() {
        let p1 = ProblemSpec::Attention(AttentionProblem::new(1, 2, 40, 32, true, DType::Bf16));
        let p2 = ProblemSpec::Attention(AttentionProblem::new(1, 2, 24, 32, false, DType::F16));
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_string_lossy().to_string();
        let replies = run_session(&[
            json!({"id": 1, "op": "prepare", "impl": "cpu-tiled", "problem": p1, "seed": 9}),
            json!({"id": 2, "op": "sample", "handle": 1, "n": 3}),
            json!({"id": 3, "op": "run_for_check", "handle": 1, "dir": d}),
            json!({"id": 4, "op": "prepare", "impl": "nope", "problem": p1, "seed": 9}),
            json!({"id": 5, "op": "prepare", "impl": "cpu-tiled", "problem": p2, "seed": 9}),
            json!({"id": 6, "op": "sample", "handle": 1}),
            json!({"id": 7, "op": "sample", "handle": 2}),
            json!({"id": 8, "op": "release", "handle": 2}),
            json!({"id": 9, "op": "quit"}),
        ]);
        assert_eq!(
            replies[0]["protocol"],
            json!(super::super::python::PROTOCOL_VERSION)
        );
        assert_eq!(replies[0]["implementations"], json!(["cpu-tiled"]));
        let by_id = |i: u64| replies.iter().find(|r| r["id"] == json!(i)).unwrap();
        let prep = by_id(1);
        assert_eq!(prep["ok"], json!(true));
        let inputs = SuiteInputs::generate(&p1, 9);
        assert_eq!(
            prep["input_checksum"],
            json!(generated_inputs_checksum(&p1, 9, &inputs))
        );
        let ms = by_id(2)["ms"].as_array().unwrap().clone();
        assert_eq!(ms.len(), 3);
        assert!(ms.iter().all(|m| m.as_f64().unwrap() > 0.0));
        let files = &by_id(3)["files"];
        let o = std::fs::read(files["o"]["path"].as_str().unwrap()).unwrap();
        let ProblemSpec::Attention(a) = &p1 else {
            unreachable!()
        };
        assert_eq!(o.len(), a.q_elems() * 4);
        assert!(files["lse"]["path"].is_string());
        assert_eq!(by_id(4)["kind"], json!("na"));
        // A prepare of another problem dropped the first problem's handles.
        assert_eq!(by_id(5)["handle"], json!(2));
        assert_eq!(by_id(6)["ok"], json!(false), "handle 1 is gone");
        assert_eq!(by_id(7)["ok"], json!(true));
        assert_eq!(by_id(8)["ok"], json!(true));
    }

    #[test]
    fn bad_lines_are_answered_not_fatal() {
        let imps: Vec<Box<dyn Implementation>> = vec![Box::new(CpuImplementation::tiled())];
        let info = ServeInfo {
            device: "cpu".into(),
            timer: "host clock".into(),
            gpu_name: None,
        };
        let mut out = Vec::new();
        serve(
            &imps,
            &info,
            "not json\n{\"id\":1,\"op\":\"sample\",\"handle\":4}\n{\"id\":2,\"op\":\"prepare\",\"problem\":{}}\n".as_bytes(),
            &mut out,
        )
        .unwrap();
        let s = String::from_utf8(out).unwrap();
        let r: Vec<Value> = s
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(r.len(), 4);
        assert_eq!(r[1]["kind"], json!("protocol"));
        assert_eq!(r[2]["ok"], json!(false));
        assert_eq!(r[3]["ok"], json!(false));
    }
}
