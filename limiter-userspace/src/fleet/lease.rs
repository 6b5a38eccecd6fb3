//! Leases on a global budget's partitions, in Redis: one key per
//! partition (`limiter:{<rule>}:<partition>`) holding the owner's token,
//! taken with `SET NX PX` (exclusive, expiring by Redis's clock, not the
//! hosts'), renewed and given back by small Lua scripts that act only if
//! the key still holds the owner's token (so a node never renews or frees
//! a lease it lost). An acquisition is one script, which Redis runs whole
//! (a rule's keys share a slot): nodes asking at once never contend for a
//! partition, each takes what is free when its script runs.
//!
//! A lease is *valid* until the moment its request was sent plus the TTL,
//! less a safety margin, as this host's monotonic clock measures: Redis
//! started the TTL after the request was sent, so a node that stops using
//! a partition at that moment stops before Redis can give it to another,
//! whatever the network delay (clock rates differ by far less than the
//! margin).

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use redis::Script;

use super::store::{Connection, StoreConfig, StoreError};

/// What leasing can fail on.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("a lease's TTL must be at least {} ms", MIN_TTL.as_millis())]
    TtlTooShort,
}

/// The shortest TTL: renewals must fit well inside it.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// The part of a TTL a node does not count on: lost to clock-rate
/// differences and scheduling.
const SAFETY: f64 = 0.1;

const RENEW: &str = r"
local renewed = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    renewed[i] = redis.call('PEXPIRE', key, ARGV[2])
  else
    renewed[i] = 0
  end
end
return renewed
";

/// Deletes each partition key (`KEYS`) that still holds this node's token.
const RELEASE: &str = r"
local freed = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    freed = freed + redis.call('DEL', key)
  end
end
return freed
";

/// Takes up to `ARGV[3]` of the partition keys (`KEYS`, in the order to
/// try them) that are free, for this node's token (`ARGV[1]`) and `ARGV[2]`
/// ms: one round trip for the lot, where a `SET NX` each made a store
/// slower than a tick unable to lease at all. Returns the (1-based)
/// indices taken, then the least time (ms) until one of the others'
/// expires, or -1.
const ACQUIRE: &str = r"
local want = tonumber(ARGV[3])
local taken = {}
local soonest = -1
for i, key in ipairs(KEYS) do
  local ttl = redis.call('PTTL', key)
  if ttl == -2 then
    if #taken < want and redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then
      taken[#taken + 1] = i
    end
  elseif ttl >= 0 and (soonest < 0 or ttl < soonest) then
    soonest = ttl
  end
end
taken[#taken + 1] = soonest
return taken
";

/// Each node's report on the rule (`KEYS[1]`, a hash of owner to
/// `expiry:held:hungry`, the expiry `ARGV[2]` ms after the report by
/// Redis's clock): records this one's, forgets the expired, and returns how
/// many nodes want more than they hold, how many partitions the others
/// hold, how long ago (ms) this store's memory of the rule began
/// (`KEYS[2]`, set by the first report after the store started empty),
/// how many entries it found malformed (another writer's, a typo): those
/// are deleted and counted, never a failure of every host's report; and
/// how many of the partitions (`KEYS[3]` on) are held under a token no
/// node reports: a foreign writer's, whose budget no node can use.
const REPORT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], (now + ttl) .. ':' .. ARGV[3] .. ':' .. ARGV[4])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
local entries = redis.call('HGETALL', KEYS[1])
local hungry, satisfied = 0, 0
local malformed = 0
local live = {}
for i = 1, #entries, 2 do
  local expiry, held, wants = string.match(entries[i + 1], '^(%d+):(%d+):([01])$')
  if not expiry then
    malformed = malformed + 1
    redis.call('HDEL', KEYS[1], entries[i])
  elseif tonumber(expiry) <= now then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    live[entries[i]] = true
    if wants == '1' then
      hungry = hungry + 1
    else
      satisfied = satisfied + tonumber(held)
    end
  end
end
local foreign = 0
for k = 3, #KEYS do
  local holder = redis.call('GET', KEYS[k])
  if holder and not live[holder] then
    foreign = foreign + 1
  end
end
-- Started empty, or its clock stepped back: its memory starts now.
local born = tonumber(redis.call('GET', KEYS[2]) or '')
if not born or born > now then
  born = now
  redis.call('SET', KEYS[2], tostring(now))
end
return {hungry, satisfied, now - born, malformed, foreign}
";

/// The fleet's nodes on a rule, as the last report counted them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peers {
    /// Nodes that want more than they hold, this one included if it does.
    pub hungry: u32,
    /// Partitions held by the nodes that do not.
    pub satisfied_held: u32,
    /// How long the store has remembered the rule: less than a TTL after
    /// it started empty (restarted, failed over), nodes may still enforce
    /// leases it forgot, so none are handed out yet.
    pub memory: Duration,
    /// Malformed entries this report found (and deleted) in the store.
    pub malformed: u32,
    /// Partitions held under a token no node reports (a foreign writer).
    pub foreign: u32,
}

/// One node's leases on one rule's partitions.
pub struct Leases {
    redis: Connection,
    prefix: String,
    partitions: u32,
    ttl: Duration,
    owner: String,
    /// Held partitions, and until when each is valid (see the module).
    held: BTreeMap<u32, Instant>,
    renew: Script,
    release: Script,
    report: Script,
    acquire: Script,
    /// When the last acquisition fell short: the earliest moment one of
    /// the partitions others held then expires.
    next_free: Option<Instant>,
}

impl Leases {
    /// Leases of `rule`'s `partitions` partitions in `store`, held `ttl`
    /// at a time, under a token of this node's own.
    pub async fn new(
        store: &StoreConfig,
        rule: &str,
        partitions: u32,
        ttl: Duration,
    ) -> Result<Self, LeaseError> {
        if ttl < MIN_TTL {
            return Err(LeaseError::TtlTooShort);
        }
        let redis = store.connect().await?;
        Ok(Self {
            redis,
            // The rule in braces: a Redis Cluster keeps all its keys in
            // one slot, so one script may touch them together.
            prefix: format!("limiter:{{{rule}}}:"),
            partitions,
            ttl,
            owner: owner_token(),
            held: BTreeMap::new(),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            report: Script::new(REPORT),
            acquire: Script::new(ACQUIRE),
            next_free: None,
        })
    }

    fn key(&self, partition: u32) -> String {
        format!("{}{partition}", self.prefix)
    }

    fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.ttl.mul_f64(1.0 - SAFETY)
    }

    /// The partitions held and valid at `now`.
    pub fn held(&self, now: Instant) -> usize {
        self.valid_beyond(now).0 as usize
    }

    /// The partitions valid until after `at`, and the earliest moment one
    /// of them stops being valid.
    pub fn valid_beyond(&self, at: Instant) -> (u32, Option<Instant>) {
        let valid = self.held.values().filter(|&&until| until > at);
        (valid.clone().count() as u32, valid.min().copied())
    }

    /// Says how many partitions this node holds and whether it wants
    /// more, and learns the same of the others (one round trip).
    pub async fn report(&mut self, hungry: bool) -> Result<Peers, LeaseError> {
        let mut invocation = self.report.prepare_invoke();
        invocation
            .key(format!("{}nodes", self.prefix))
            .key(format!("{}memory", self.prefix));
        for p in 0..self.partitions {
            invocation.key(self.key(p));
        }
        invocation
            .arg(&self.owner)
            // Three ticks: a dead node stops counting well before its
            // leases expire, so the others may take them at once.
            .arg((self.ttl / 3).as_millis() as u64)
            .arg(self.held.len())
            .arg(u8::from(hungry));
        let counts: Vec<u64> = invocation.invoke_async(&mut self.redis).await?;
        let count = |i: usize| counts.get(i).copied().unwrap_or(0);
        Ok(Peers {
            hungry: count(0) as u32,
            satisfied_held: count(1) as u32,
            memory: Duration::from_millis(count(2)),
            malformed: count(3) as u32,
            foreign: count(4) as u32,
        })
    }

    /// One round trip to the store, to know it answers when nothing is
    /// held.
    pub async fn ping(&mut self) -> Result<(), LeaseError> {
        let _: String = redis::cmd("PING").query_async(&mut self.redis).await?;
        Ok(())
    }

    /// When the last acquisition fell short of what it asked: the earliest
    /// moment a partition another node held may be free.
    pub fn next_free(&self) -> Option<Instant> {
        self.next_free
    }

    /// The partitions held, in order.
    pub fn partitions(&self) -> Vec<u32> {
        self.held.keys().copied().collect()
    }

    /// Leases up to `n` more partitions, the first free ones, in one round
    /// trip (which also says when the others' leases expire);
    /// returns those gained.
    pub async fn acquire(&mut self, n: u32) -> Result<Vec<u32>, LeaseError> {
        let candidates: Vec<u32> = (0..self.partitions)
            .filter(|p| !self.held.contains_key(p))
            .collect();
        self.next_free = None;
        if n == 0 || candidates.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.acquire.prepare_invoke();
        for &p in &candidates {
            invocation.key(self.key(p));
        }
        invocation
            .arg(&self.owner)
            .arg(self.ttl.as_millis() as u64)
            .arg(n);
        let sent = Instant::now();
        let mut answer: Vec<i64> = invocation.invoke_async(&mut self.redis).await?;
        // Redis counted the others' TTLs from when the request arrived,
        // after it was sent: they expire no earlier than this, by this clock.
        let soonest = answer.pop().unwrap_or(-1);
        let until = self.valid_until(sent);
        let mut gained = Vec::new();
        for index in answer {
            let Some(&partition) = usize::try_from(index - 1)
                .ok()
                .and_then(|i| candidates.get(i))
            else {
                continue;
            };
            self.held.insert(partition, until);
            gained.push(partition);
        }
        if (gained.len() as u32) < n {
            self.next_free = u64::try_from(soonest)
                .ok()
                .map(|ms| sent + Duration::from_millis(ms));
        }
        Ok(gained)
    }

    /// Renews every partition held, in one round trip; returns those lost
    /// (expired, or taken by another node after expiring).
    pub async fn renew(&mut self) -> Result<Vec<u32>, LeaseError> {
        if self.held.is_empty() {
            return Ok(Vec::new());
        }
        let partitions = self.partitions();
        let mut invocation = self.renew.prepare_invoke();
        for &p in &partitions {
            invocation.key(self.key(p));
        }
        invocation.arg(&self.owner).arg(self.ttl.as_millis() as u64);
        let sent = Instant::now();
        let renewed: Vec<i64> = invocation.invoke_async(&mut self.redis).await?;
        let until = self.valid_until(sent);
        let mut lost = Vec::new();
        for (p, ok) in partitions.into_iter().zip(renewed) {
            if ok == 1 {
                self.held.insert(p, until);
            } else {
                self.held.remove(&p);
                lost.push(p);
            }
        }
        Ok(lost)
    }

    /// Gives back up to `n` partitions (those it still owns are deleted at
    /// once, free for others); returns those given back.
    pub async fn release(&mut self, n: u32) -> Result<Vec<u32>, LeaseError> {
        let give = self.forget(n);
        self.free(&give).await?;
        Ok(give)
    }

    /// Stops counting (and renewing) up to `n` partitions; returns them.
    /// Not yet free for others: [`Leases::free`] them once nothing
    /// enforces them any more, or they expire by themselves.
    pub fn forget(&mut self, n: u32) -> Vec<u32> {
        let give: Vec<u32> = self.held.keys().rev().take(n as usize).copied().collect();
        for p in &give {
            self.held.remove(p);
        }
        give
    }

    /// Deletes forgotten partitions that are still this node's, in one
    /// round trip.
    pub async fn free(&mut self, partitions: &[u32]) -> Result<(), LeaseError> {
        if partitions.is_empty() {
            return Ok(());
        }
        let mut invocation = self.release.prepare_invoke();
        for &p in partitions {
            invocation.key(self.key(p));
        }
        invocation.arg(&self.owner);
        let _: i64 = invocation.invoke_async(&mut self.redis).await?;
        Ok(())
    }
}

/// The token a node's leases are held under: its host and process, for
/// whoever reads the store, and a random part, so that a restarted
/// process with the same pid never takes a dead one's leases for its own.
fn owner_token() -> String {
    let seed = {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one((std::process::id(), Instant::now()))
    };
    format!("{}-{}-{seed:016x}", hostname(), std::process::id())
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "host".into())
}

#[cfg(test)]
mod tests {
    /// An operator reading the store's keys sees which host and process
    /// holds a partition; two nodes of one process never share a token.
    #[test]
    fn an_owner_token_names_the_host_and_the_process() {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        let token = super::owner_token();
        let prefix = format!("{}-{}-", host.trim(), std::process::id());
        let random = token
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{token}"));
        assert!(
            random.len() == 16 && random.chars().all(|c| c.is_ascii_hexdigit()),
            "{token}"
        );
        assert_ne!(super::owner_token(), token);
    }
}
