//! Fleet-wide limits (issue 8, in progress): one rule's budget shared by
//! every node, split into equal partitions that nodes lease from Redis
//! ahead of time, so a packet or a request only ever checks local state.
//! Done so far: the store's settings ([`store`]), the leases ([`lease`]),
//! how many to hold ([`share`]) and one node's share tick by tick, Redis
//! down included ([`node`]).
//! Not yet: the loop that turns them into the kernel's and layer 7's
//! aggregate budgets, the rule-file fields, the daemon's configuration
//! and metrics.

pub mod lease;
pub mod node;
pub mod share;
pub mod store;
