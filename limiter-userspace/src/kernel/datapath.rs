//! The loaded program and its maps (`Datapath`): its loading and its
//! state here; attaching (`links`), rule generations (`generations`),
//! blocks (`blocks`) and re-pinning (`repin`) add their methods to it.

use std::path::{Path, PathBuf};

use aya::{Ebpf, programs::Xdp};
use limiter_common::abi::GlobalConfig;

use super::{KernelError, Maps, OBJECT, PROGRAM, maps::map_error, object, repin, report};

/// A loaded limiter program and its (pinned) maps.
pub struct Datapath {
    pub(super) ebpf: Ebpf,
    pub(super) maps: Maps,
    pub(super) pin_dir: PathBuf,
    /// References that keep maps and links alive without their pins.
    pub(super) held: repin::Held,
    /// When the key filter last switched halves (see `rebuild_key_filter`).
    pub(super) filter_switched: Option<std::time::Instant>,
    /// The kernel's rare events, drained into the logs once
    /// [`Datapath::log_reports`] starts it, while the datapath is open.
    pub(super) reports: Option<report::ReportLogs>,
}

impl Datapath {
    /// Loads the embedded object with its maps pinned under `pin_dir`:
    /// maps already pinned there are reused, state and all.
    pub fn open(pin_dir: &Path, max_keys: u32) -> Result<Self, KernelError> {
        Self::open_object(OBJECT, pin_dir, max_keys)
    }

    /// Loads a given object (the tests load the build that takes its clock
    /// from a map).
    pub fn open_object(object: &[u8], pin_dir: &Path, max_keys: u32) -> Result<Self, KernelError> {
        let mut ebpf = object::load(object, pin_dir, max_keys)?;
        // The maps the load pinned (a scratch map is not pinned).
        let names: Vec<String> = ebpf
            .maps()
            .map(|(name, _)| name.to_owned())
            .filter(|name| pin_dir.join(name).exists())
            .collect();
        let held = repin::Held::maps(pin_dir, &names)?;
        let maps = Maps::take(&mut ebpf)?;
        let reports = report::ReportLogs::new(&mut ebpf);
        let mut datapath = Self {
            ebpf,
            maps,
            pin_dir: pin_dir.to_owned(),
            held,
            filter_switched: None,
            reports,
        };
        datapath.describe_key_table()?;
        // Complete for the keys of a table adopted from pins (an older
        // build kept no filter).
        datapath.rebuild_key_filter()?;
        datapath.write_v4_coverage()?;
        Ok(datapath)
    }

    /// Starts draining the kernel's rare events (`kernel::report`) into
    /// this process's logs, on a thread that gets this thread's
    /// capabilities: call it once those are what the process keeps.
    pub fn log_reports(&mut self) {
        if let Some(reports) = &mut self.reports {
            reports.start();
        }
    }

    /// Tells the program the key table's size, and gives a new table its
    /// hash seed (a table adopted from pins keeps the seed its keys were
    /// placed with).
    fn describe_key_table(&mut self) -> Result<(), KernelError> {
        let mut config = self.config()?;
        config.key_buckets = self.maps.keys.buckets();
        if config.key_seed == 0 {
            let mut seed = [0u8; 8];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed))
                .map_err(|source| KernelError::Io {
                    path: "/dev/urandom".into(),
                    source,
                })?;
            config.key_seed = u64::from_ne_bytes(seed) | 1;
        }
        self.set_config(config)
    }

    /// Rebuilds the key table's presence filter when bits of keys gone
    /// since (evicted, forgotten) set over 1/32 of it beyond what the
    /// `keys_held` the table holds now explain (the caller has just
    /// counted them); whether it did. Cheap when it does not: a count of
    /// the active half's bits.
    pub fn refresh_key_filter(&mut self, keys_held: usize) -> Result<bool, KernelError> {
        let config = self.config()?;
        let (set, bits) = self.maps.keys.filter_fill(config.key_filter);
        let explained = bits as f64 * (1.0 - (-(keys_held as f64) / bits as f64).exp());
        if (set as f64) <= explained + bits as f64 / 32.0 {
            return Ok(false);
        }
        self.rebuild_key_filter()?;
        Ok(true)
    }

    /// Rebuilds the inactive half of the key table's presence filter from
    /// the table and switches the kernel to it.
    pub fn rebuild_key_filter(&mut self) -> Result<(), KernelError> {
        let mut config = self.config()?;
        // The half about to be cleared was the active one until the last
        // switch: packets that read the switch before it are long done
        // after a grace period.
        if let Some(wait) = self
            .filter_switched
            .and_then(|at| crate::clock::GRACE.checked_sub(at.elapsed()))
        {
            std::thread::sleep(wait);
        }
        config.key_filter = self
            .maps
            .keys
            .rebuild_filter(config.key_seed, config.key_filter);
        self.set_config(config)?;
        self.filter_switched = Some(std::time::Instant::now());
        Ok(())
    }

    /// The program's clock, in ns of `CLOCK_MONOTONIC` (a test build's:
    /// the time its test set), for state userspace computes beside it.
    pub fn clock_ns(&self) -> u64 {
        match &self.maps.test_clock {
            Some(clock) => clock.get(&0, 0).unwrap_or(0),
            None => crate::clock::monotonic_ns(),
        }
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    pub fn config(&self) -> Result<GlobalConfig, KernelError> {
        self.maps
            .config
            .get(&0, 0)
            .map_err(map_error(limiter_common::abi::map_name::CONFIG))
    }

    pub fn set_config(&mut self, value: GlobalConfig) -> Result<(), KernelError> {
        self.maps
            .config
            .set(0, value, 0)
            .map_err(map_error(limiter_common::abi::map_name::CONFIG))
    }

    pub fn program(&self) -> &Xdp {
        self.ebpf
            .program(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .expect("checked at load")
    }

    /// How many instructions the verifier processed for each program of
    /// the object, by name (kernels before 5.16 do not say: `None`).
    pub fn verified_instructions(&self) -> Vec<(String, Option<u32>)> {
        let mut counts: Vec<(String, Option<u32>)> = self
            .ebpf
            .programs()
            .map(|(name, program)| {
                let count = program
                    .info()
                    .ok()
                    .and_then(|info| info.verified_instruction_count());
                (name.to_owned(), count)
            })
            .collect();
        counts.sort();
        counts
    }

    /// Each loaded program's name and kernel id.
    pub fn program_ids(&self) -> Vec<(String, u32)> {
        let mut ids: Vec<(String, u32)> = self
            .ebpf
            .programs()
            .filter_map(|(name, program)| Some((name.to_owned(), program.info().ok()?.id())))
            .collect();
        ids.sort();
        ids
    }

    /// Whether everything pinned is still there (the maps' and the links'
    /// pins).
    pub fn pins_intact(&self) -> bool {
        self.held.intact(&self.pin_dir)
    }

    /// Lets go of the links (a detach): they live on only by their pins,
    /// which the detach removes, and are never pinned again.
    pub fn release_links(&mut self) {
        self.held.release_links();
    }

    /// Pins again what is missing (see `repin`); how many pins were
    /// written.
    pub fn repin(&mut self) -> Result<usize, KernelError> {
        self.held.repin(&self.pin_dir)
    }

    pub(super) fn program_mut(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut(PROGRAM)
            .and_then(|p| p.try_into().ok())
            .expect("checked at load")
    }
}
