//! The rule file: the validated rule set and what it means (`set`),
//! shared by the kernel and layer 7. The fields as written (`raw`), the
//! checks (`validate`), reading a file through both (`load`), which rule
//! applies to a packet ([`matching`]), what identifies a rule's buckets
//! (`fingerprint`), which new rule takes which old one's state
//! ([`pairing`]), and a rule in words
//! ([`describe`]). Reading YAML, with file, line and field in every
//! error, is [`crate::yaml`]'s.

pub mod describe;
mod fingerprint;
mod invalid;
mod load;
pub mod matching;
pub mod pairing;
mod raw;
pub mod request;
mod set;
mod validate;
pub mod watch;

pub use crate::yaml::InvalidFile;
pub use invalid::InvalidField;
pub use load::EXAMPLE;
pub use raw::{Algorithm, EscalateScope, Fallback, FragmentPolicy, Scope};
pub use request::{HttpRequest, KeyPart, RequestMatch};
pub use set::{
    CostClass, EscalationPolicy, FULL_FRAME, FleetShare, KeyPrefix, Layer7Only, Limit, Match, Rate,
    Rates, Rule, RuleSet, TcpFlags, ThirdLimit,
};
pub use validate::{BadText, parse_net, parse_unit};

#[cfg(test)]
mod tests;
