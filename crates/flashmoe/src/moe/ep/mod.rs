//! Expert parallelism: the MoE layer across the GPUs of one host, one process per GPU,
//! NCCL for the token traffic ([`ExpertParallelMoe`]).
//!
//! - [`placement`]: which rank owns which experts (validated up front);
//! - [`exchange`]: the all-to-all schedule of a call, from the exchanged counts (pure);
//! - [`comm`]: the NCCL communicator (cudarc's bindings, loaded at run time), with
//!   deadlines and abort on every wait;
//! - [`layer`]: the layer itself on the single-GPU plan's kernels.
//!
//! `simulate_cpu` runs the same schedule for every rank on the CPU reference, so the
//! decomposition is tested without GPUs (it must reproduce the single-GPU reference
//! bit for bit); `simulate_backward_cpu` does the same for the backward the layer does not
//! have yet (dY along the forward's dispatch, the expert gradients on their owner, dX back:
//! each rank's dx and router gradient the single-GPU backward's on its tokens).

pub mod comm;
pub mod exchange;
pub mod layer;
pub mod placement;
#[cfg(feature = "lab")]
mod sim;
#[cfg(feature = "lab")]
mod sim_backward;

pub use comm::{find_nccl_library, nccl_version, Communicator, NcclId};
pub use exchange::Exchange;
pub use layer::{ExchangeTiming, ExpertParallelMoe};
pub use placement::ExpertPlacement;
#[cfg(feature = "lab")]
pub use sim::simulate_cpu;
#[cfg(feature = "lab")]
pub use sim_backward::{simulate_backward_cpu, EpRankGradients};
