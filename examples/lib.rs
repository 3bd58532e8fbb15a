//! Empty: this package exists for its examples (see Cargo.toml).
