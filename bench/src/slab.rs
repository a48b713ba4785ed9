//! The kernel's share of a connection: its slab caches (`/proc/slabinfo`,
//! readable by root), summed as active objects times object size.
//!
//! The caches are the whole machine's: read them before and after opening
//! connections, on a machine otherwise quiet, and look at which caches grew
//! (`tcp_sock`... for sockets; `dentry` and inodes also grow with any build
//! running beside).

use std::collections::BTreeMap;

/// Bytes in use per slab cache, at one moment.
pub struct Slabs(BTreeMap<String, u64>);

impl Slabs {
    /// The caches now, or `None` if `/proc/slabinfo` cannot be read (not root).
    pub fn read() -> Option<Slabs> {
        let text = std::fs::read_to_string("/proc/slabinfo").ok()?;
        Some(Slabs(parse(&text)))
    }

    /// Growth per cache since `before`, largest first, in bytes.
    pub fn growth_since(&self, before: &Slabs) -> Vec<(String, i64)> {
        let mut growth: Vec<(String, i64)> = self
            .0
            .iter()
            .map(|(name, &now)| {
                let then = before.0.get(name).copied().unwrap_or(0);
                (name.clone(), now as i64 - then as i64)
            })
            .filter(|(_, grew)| *grew != 0)
            .collect();
        growth.sort_by_key(|(_, grew)| -grew);
        growth
    }

    /// Growth of all caches together since `before`, in bytes.
    pub fn total_growth_since(&self, before: &Slabs) -> i64 {
        self.growth_since(before).iter().map(|(_, grew)| grew).sum()
    }
}

/// `name active_objs num_objs objsize ...` lines, after two header lines.
fn parse(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter(|line| !line.starts_with("slabinfo") && !line.starts_with('#'))
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let name = fields.next()?;
            let active: u64 = fields.next()?.parse().ok()?;
            let _total = fields.next()?;
            let size: u64 = fields.next()?.parse().ok()?;
            Some((name.to_owned(), active * size))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_are_summed_as_active_objects_times_size() {
        let before = Slabs(parse(
            "slabinfo - version: 2.1\n\
             # name <active_objs> <num_objs> <objsize> ...\n\
             TCP 10 20 2432 13 8 : tunables 0 0 0 : slabdata 1 1 0\n\
             dentry 100 100 192 21 1 : tunables 0 0 0 : slabdata 5 5 0\n",
        ));
        let after = Slabs(parse(
            "TCP 12 20 2432 13 8 : tunables 0 0 0 : slabdata 1 1 0\n\
             dentry 99 100 192 21 1 : tunables 0 0 0 : slabdata 5 5 0\n\
             filp 3 16 256 16 1 : tunables 0 0 0 : slabdata 1 1 0\n",
        ));
        assert_eq!(
            after.growth_since(&before),
            vec![
                ("TCP".to_owned(), 2 * 2432),
                ("filp".to_owned(), 3 * 256),
                ("dentry".to_owned(), -192),
            ]
        );
        assert_eq!(after.total_growth_since(&before), 4864 + 768 - 192);
    }
}
