//! The kernel's rare events (a key table with no slot for a new key, a
//! packet whose meter updates lost every retry): the report program logs
//! them with aya-log, and a thread of this process drains its records into
//! this process's logs (through `log`, which the `tracing` subscriber
//! forwards). The thread starts when asked ([`ReportLogs::start`]), not at
//! load: capabilities belong to threads, and the daemon starts it once it
//! has dropped all it does not need, so the thread holds no more.

use std::{
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
};

use aya::Ebpf;
use aya_log::EbpfLogger;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

/// How long the drain waits for records before it checks whether the
/// datapath is gone.
const WAKE_MS: u16 = 250;

/// The report program's records: drained by a thread once started,
/// while this lives.
pub struct ReportLogs {
    logger: Option<EbpfLogger<&'static dyn log::Log>>,
    stop: Arc<AtomicBool>,
}

impl ReportLogs {
    /// Takes the report program's records from `ebpf`; `None` for an
    /// object without one (a build before it, as the bench's baseline may
    /// be).
    pub fn new(ebpf: &mut Ebpf) -> Option<Self> {
        match EbpfLogger::init(ebpf) {
            Ok(logger) => Some(Self {
                logger: Some(logger),
                stop: Arc::new(AtomicBool::new(false)),
            }),
            Err(aya_log::Error::MapNotFound) => None,
            Err(e) => {
                tracing::warn!("the kernel's rare events will not be logged: {e}");
                None
            }
        }
    }

    /// Starts draining them on a thread of their own (once; later calls
    /// do nothing).
    pub fn start(&mut self) {
        let Some(mut logger) = self.logger.take() else {
            return;
        };
        let stopped = Arc::clone(&self.stop);
        let spawned = thread::Builder::new()
            .name("kernel-reports".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    let mut fds = [PollFd::new(logger.as_fd(), PollFlags::POLLIN)];
                    // An error (EINTR) only means another look sooner.
                    let _ = poll(&mut fds, PollTimeout::from(WAKE_MS));
                    logger.flush();
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("the kernel's rare events will not be logged: {e}");
        }
    }
}

impl Drop for ReportLogs {
    fn drop(&mut self) {
        // The thread sees it within `WAKE_MS` and ends; nothing waits.
        self.stop.store(true, Ordering::Relaxed);
    }
}
