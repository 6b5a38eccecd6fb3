//! Leases on a global budget's partitions, against a real `redis-server`
//! that the test starts on loopback (and stops): exclusive, renewed,
//! given back, and expiring by Redis's clock when a node stops renewing
//! (`leases`); a node's share following its traffic within the budget
//! (`nodes`); the store's connection: TLS, a store that forgets, a cluster
//! (`store`).

mod leases;
mod nodes;
mod store;

use std::{collections::BTreeSet, net::Ipv4Addr};

use limiter::{fleet::store::StoreConfig, lab::store::RedisServer};

/// A redis-server of the test's own on a free loopback port.
fn redis(password: Option<&str>) -> RedisServer {
    RedisServer::start(None, &[Ipv4Addr::LOCALHOST.into()], 0, password)
        .expect("redis-server (cargo xtask setup installs it)")
}

fn store(redis: &RedisServer) -> StoreConfig {
    StoreConfig::at(redis.url())
}

fn set(partitions: &[u32]) -> BTreeSet<u32> {
    partitions.iter().copied().collect()
}
