//! Field types and serde defaults every family's TOML entries share (`[[attention]]`,
//! `[[moe]]`, ...). Below the families' `config.rs` files and the top-level `config.rs` that
//! dispatches to them, so neither imports the other for these.

use serde::Deserialize;

/// A value or a list of values (each value gives one config).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub(crate) fn values(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

pub(crate) fn no() -> OneOrMany<bool> {
    OneOrMany::One(false)
}
pub(crate) fn bf16() -> String {
    "bf16".into()
}
