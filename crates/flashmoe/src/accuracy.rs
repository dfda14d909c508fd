//! Error metrics against a reference, and per-dtype tolerances.
// (filled in by the reference work; placeholder keeps the crate compiling)
