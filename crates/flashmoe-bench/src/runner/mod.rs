//! Runners (in progress).
