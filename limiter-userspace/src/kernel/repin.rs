//! Pins lost under a running daemon (bpffs unmounted, or the pin directory
//! deleted): the program keeps enforcing, because the daemon holds its own
//! reference to every map and every XDP link, not only the pins; the loss
//! is reported, and the pins are written again as soon as a bpffs is
//! mounted where they lived, so a later daemon can adopt the state.

use std::path::{Path, PathBuf};

use aya::{
    maps::MapData,
    programs::links::{FdLink, PinnedLink},
};

use super::{Datapath, KernelError, pins};

/// The daemon's own references: a handle on each pinned map, and each
/// pinned link with where it was pinned.
#[derive(Default)]
pub struct Held {
    maps: Vec<(String, MapData)>,
    links: Vec<(PathBuf, PinnedLink)>,
}

impl Held {
    /// Opens every map pinned under `pin_dir` once more: a handle that
    /// outlives the pins.
    pub fn maps(pin_dir: &Path, names: &[String]) -> Result<Self, KernelError> {
        let maps = names
            .iter()
            .map(|name| {
                MapData::from_pin(pin_dir.join(name))
                    .map(|data| (name.clone(), data))
                    .map_err(|source| KernelError::Map {
                        name: name.clone(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            maps,
            links: Vec::new(),
        })
    }

    /// Keeps a reference to the link pinned at `path`.
    pub fn link(&mut self, path: &Path) -> Result<(), KernelError> {
        let link = PinnedLink::from_pin(path).map_err(|e| KernelError::Adopt {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
        self.links.push((path.to_owned(), link));
        Ok(())
    }
}

impl Datapath {
    /// Whether everything pinned is still there (the maps' and the links'
    /// pins).
    pub fn pins_intact(&self) -> bool {
        self.held
            .maps
            .iter()
            .all(|(name, _)| self.pin_dir.join(name).exists())
            && self.held.links.iter().all(|(path, _)| path.exists())
    }

    /// Pins again what is missing, once the pin directory's parent is a
    /// bpffs again; returns how many pins were written (0: nothing to do,
    /// or no bpffs to write them in yet).
    pub fn repin(&mut self) -> Result<usize, KernelError> {
        let parent = self.pin_dir.parent().unwrap_or(Path::new("/"));
        if !pins::is_bpffs(parent).unwrap_or(false) || self.pins_intact() {
            return Ok(0);
        }
        pins::private_dir(&self.pin_dir)?;
        let mut written = 0;
        for (name, data) in &self.held.maps {
            let path = self.pin_dir.join(name);
            if !path.exists() {
                data.pin(&path).map_err(|e| KernelError::Adopt {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
                written += 1;
            }
        }
        let links = std::mem::take(&mut self.held.links);
        for (path, link) in links {
            if path.exists() {
                self.held.links.push((path, link));
                continue;
            }
            pins::private_dir(path.parent().expect("a links dir"))?;
            let link = FdLink::from(link)
                .pin(&path)
                .map_err(|e| KernelError::Adopt {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            self.held.links.push((path, link));
            written += 1;
        }
        Ok(written)
    }
}
