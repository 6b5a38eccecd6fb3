//! What the control protocol carries: the replies of the daemon's control
//! socket (`control`), which the CLI prints (`render`) and scripts read
//! (`--json`). They are the protocol's own: the kernel module and the
//! engine fill them in, and they change only with the protocol.

mod rules;
mod stats;
mod status;

pub use rules::{BlockView, Change, RuleView, RulesView};
pub use stats::{InterfaceStats, KeyMapSize, OrphanFragments, RuleStats, Snapshot};
pub use status::{Attachment, Detached, Mode, Status};
