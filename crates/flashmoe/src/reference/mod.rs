//! CPU reference implementations.
