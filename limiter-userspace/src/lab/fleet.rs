//! A fleet on one machine: `hosts` two-namespace labs ([`Lab`]), whose
//! receiving namespaces (the hosts) each reach a store namespace running
//! its own `redis-server` over a veth link of their own, as edge hosts
//! reach a shared Redis. Used by `limiter lab --fleet` and the tests.
//! Redis listens only on those links, with a password in a file.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{Lab, Netns, netns, store::RedisServer};

/// The port Redis listens on in the store namespace.
pub const STORE_PORT: u16 = 6379;

pub struct FleetLab {
    pub hosts: Vec<Lab>,
    pub store: Netns,
    /// Behind a lock so a test can stop it while its floods borrow the hosts.
    redis: std::sync::Mutex<RedisServer>,
    password_file: PathBuf,
}

/// The store's address on host `n`'s link, and the host's.
fn link_addrs(n: usize) -> (String, String) {
    (format!("10.250.{n}.1"), format!("10.250.{n}.2"))
}

impl FleetLab {
    /// Builds `hosts` labs named `<name><n>` and the store namespace
    /// `<name>-store`, and starts Redis; the password goes in `dir`.
    pub fn create(name: &str, hosts: usize, dir: &Path) -> Result<Self> {
        let store = Netns::create(&format!("{name}-store"))?;
        let password_file = dir.join("redis-password");
        let password = {
            use std::hash::{BuildHasher, RandomState};
            format!(
                "{:016x}{:016x}",
                RandomState::new().hash_one(std::process::id()),
                RandomState::new().hash_one(Instant::now())
            )
        };
        std::fs::write(&password_file, format!("{password}\n"))
            .with_context(|| format!("writing {}", password_file.display()))?;
        let mut labs = Vec::with_capacity(hosts);
        for n in 0..hosts {
            let lab = Lab::create(&format!("{name}{n}"))?;
            let (store_if, host_if) = (format!("store{n}"), "store".to_owned());
            netns::run(
                "ip",
                &[
                    "link",
                    "add",
                    &store_if,
                    "netns",
                    store.name(),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &host_if,
                    "netns",
                    lab.rx.name(),
                ],
            )?;
            let (store_addr, host_addr) = link_addrs(n);
            for (ns, iface, addr) in [
                (&store, &store_if, &store_addr),
                (&lab.rx, &host_if, &host_addr),
            ] {
                ns.exec("ip", &["addr", "add", &format!("{addr}/30"), "dev", iface])?;
                ns.exec("ip", &["link", "set", iface, "up"])?;
            }
            labs.push(lab);
        }
        let binds: Vec<IpAddr> = (0..hosts)
            .map(|n| link_addrs(n).0.parse().expect("an address"))
            .collect();
        let redis = RedisServer::start(Some(store.name()), &binds, STORE_PORT, Some(&password))?;
        let fleet = Self {
            hosts: labs,
            store,
            redis: std::sync::Mutex::new(redis),
            password_file,
        };
        Ok(fleet)
    }

    /// The daemon configuration's `fleet:` section for host `n`.
    pub fn fleet_section(&self, n: usize, lease_ttl: Duration) -> String {
        format!(
            "fleet:\n  store:\n    url: {}\n    password_file: {}\n  lease_ttl: {}\n",
            self.store_url(n),
            self.password_file.display(),
            humantime::format_duration(lease_ttl)
        )
    }

    /// Where host `n` reaches the store.
    pub fn store_url(&self, n: usize) -> String {
        format!("redis://{}:{STORE_PORT}/", link_addrs(n).0)
    }

    /// A connection to the store made from its own namespace, with the
    /// hosts' password: for watching the leases from outside the hosts.
    pub fn store_connection(&self) -> Result<redis::Connection> {
        let password = std::fs::read_to_string(&self.password_file)
            .with_context(|| format!("reading {}", self.password_file.display()))?;
        let url = self.store_url(0);
        self.store.enter(|| -> Result<redis::Connection> {
            let mut connection = redis::Client::open(url.as_str())?.get_connection()?;
            redis::cmd("AUTH")
                .arg(password.trim_end())
                .query::<()>(&mut connection)?;
            Ok(connection)
        })?
    }

    /// Starts Redis in the store namespace again.
    pub fn start_store(&self) -> Result<()> {
        self.redis.lock().expect("redis lock").resume()
    }

    /// Stops Redis at once (SIGKILL: no goodbye to the clients).
    pub fn stop_store(&self) {
        self.redis.lock().expect("redis lock").stop();
    }
}
