//! The lab's one way to run a native GPU implementation: a family supplies a [`PlanCall`]
//! (its plan, the buffers the plan's raw arguments point into, how to poison and read its
//! outputs); [`PlanBacked`] owns what every family does the same way — timing a launch
//! between CUDA events after an L2 flush ([`GpuSession::timed`]), and the check run: poison
//! the outputs, launch, synchronise, download.

use super::session::GpuSession;
use super::{Outputs, Prepared};
use crate::measure::Sampled;
use flashmoe::gpu::{Device, DeviceTensor};
use std::rc::Rc;

/// One family's prepared call over buffers it owns.
pub(crate) trait PlanCall {
    /// Enqueue one call on the device's stream (no allocation, no sync).
    fn launch(&mut self, dev: &Device) -> flashmoe::Result<()>;
    /// Fill every output with a value no correct run writes (NaN, or all-ones ids), ordered
    /// on the device's stream before the next launch.
    fn poison(&mut self, dev: &Device) -> flashmoe::Result<()>;
    /// The outputs of the run that just completed (the stream is synchronised).
    fn outputs(&mut self, dev: &Device) -> anyhow::Result<Outputs>;
    /// Work to do once after the check run's outputs are read (e.g. timing a stage alone).
    fn after_check(&mut self, _session: &GpuSession) -> anyhow::Result<()> {
        Ok(())
    }
    /// See [`Prepared::peak_extra_bytes`].
    fn peak_extra_bytes(&self) -> Option<u64>;
    /// See [`Prepared::router_ms`].
    fn router_ms(&self) -> Option<f64> {
        None
    }
    /// See [`Prepared::notes`].
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A [`PlanCall`] run by the framework: implements [`Sampled`] and [`Prepared`].
pub(crate) struct PlanBacked<C> {
    pub(crate) session: Rc<GpuSession>,
    pub(crate) call: C,
}

impl<C: PlanCall> PlanBacked<C> {
    pub(crate) fn new(session: &Rc<GpuSession>, call: C) -> Self {
        PlanBacked {
            session: session.clone(),
            call,
        }
    }
}

impl<C: PlanCall> Sampled for PlanBacked<C> {
    fn sample(&mut self) -> anyhow::Result<f64> {
        let (session, call) = (&self.session, &mut self.call);
        session.timed(|| call.launch(&session.device))
    }
}

impl<C: PlanCall> Prepared for PlanBacked<C> {
    fn run_for_check(&mut self) -> anyhow::Result<Outputs> {
        let dev = &self.session.device;
        self.call.poison(dev)?;
        self.call.launch(dev)?;
        dev.synchronize()?;
        let out = self.call.outputs(dev)?;
        self.call.after_check(&self.session)?;
        Ok(out)
    }
    fn peak_extra_bytes(&self) -> Option<u64> {
        self.call.peak_extra_bytes()
    }
    fn router_ms(&self) -> Option<f64> {
        self.call.router_ms()
    }
    fn notes(&self) -> Vec<String> {
        self.call.notes()
    }
}

/// The outputs of an attention call: o and the natural-log lse.
pub(crate) struct AttentionOut {
    pub(crate) o: DeviceTensor,
    pub(crate) lse: DeviceTensor,
}

impl AttentionOut {
    pub(crate) fn poison(&mut self, dev: &Device) -> flashmoe::Result<()> {
        self.o.poison(dev)?;
        self.lse.poison(dev)
    }
    pub(crate) fn download(&self, dev: &Device) -> anyhow::Result<Outputs> {
        Ok(Outputs::Attention {
            o: self.o.to_f32(dev)?,
            lse: self.lse.to_f32(dev)?,
        })
    }
}
