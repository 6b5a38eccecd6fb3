//! What the XDP program and userspace share: the rate-limiting algorithm
//! (one implementation, compiled for both) and the layout of the maps.
#![no_std]

pub mod abi;
pub mod escalation;
pub mod gcra;
pub mod keytable;
#[cfg(feature = "user")]
pub mod log;
pub mod meter;
pub mod segments;
pub mod trace;
pub mod window;
