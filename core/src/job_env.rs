//! What a job learns about its locks, for either backend: the one builder of
//! the command's `DEVLOCK_*` variables (and etcd's, and the GPUs' own).

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::resource::Resource;

/// Variables set for the command, over devlock's own environment.
pub type Env = Vec<(OsString, OsString)>;

/// The facts a job's variables are made from.
#[derive(Debug)]
pub struct JobEnv<'a> {
    /// What the job got: the members an `--any` chose, not the groups taken
    /// on their behalf (`DEVLOCK_RESOURCES`, and the GPUs' variables).
    pub resources: Vec<&'a Resource>,
    pub step: &'a str,
    /// The scratch directory (lock files only): `DEVLOCK_DIR`.
    pub dir: Option<&'a Path>,
    /// A semaphore's slot: `DEVLOCK_SLOT`.
    pub slot: Option<u64>,
    /// etcd's fencing tokens, in the order of the resources: `DEVLOCK_FENCE`.
    pub fences: Option<String>,
    /// What `etcdctl lock` tells its command, for the first resource, so
    /// scripts written for it run unchanged: `ETCD_LOCK_KEY` and, where
    /// known, `ETCD_LOCK_REV`.
    pub lock_key: Option<(String, Option<i64>)>,
}

impl JobEnv<'_> {
    /// The variables, the GPUs' as this machine's driver numbers them (a
    /// MIG instance's UUID from a probe, which may take `probe_timeout`).
    pub fn vars(&self, probe_timeout: Duration) -> Result<Env> {
        let names: Vec<&str> = self.resources.iter().map(|r| r.as_str()).collect();
        let mut env = Env::new();
        env.push(("DEVLOCK_RESOURCES".into(), names.join(" ").into()));
        if let Some(dir) = self.dir {
            // Absolute, so that a nested devlock that changed directory meets
            // the same gate, and byte for byte as given (not every path is UTF-8).
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
            env.push(("DEVLOCK_DIR".into(), dir.into_os_string()));
        }
        env.push(("DEVLOCK_STEP".into(), self.step.into()));
        if let Some(fences) = &self.fences {
            env.push(("DEVLOCK_FENCE".into(), fences.into()));
        }
        if let Some(slot) = self.slot {
            env.push(("DEVLOCK_SLOT".into(), slot.to_string().into()));
        }
        if let Some((key, rev)) = &self.lock_key {
            env.push(("ETCD_LOCK_KEY".into(), key.into()));
            if let Some(rev) = rev {
                env.push(("ETCD_LOCK_REV".into(), rev.to_string().into()));
            }
        }
        // A MIG instance is named to CUDA by its UUID, which only the probe knows.
        let gpu_env = match self.resources.iter().find(|r| r.mig_parent().is_some()) {
            Some(instance) => crate::gpu::cuda::mig_env(
                instance,
                &crate::gpu::source::probe(probe_timeout).report,
            )?,
            None => crate::gpu::cuda::child_env(self.resources.iter().copied()),
        };
        env.extend(gpu_env.into_iter().map(|(k, v)| (k.into(), v.into())));
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(job: &JobEnv) -> Vec<(String, String)> {
        job.vars(Duration::ZERO)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.into_string().unwrap(), v.into_string().unwrap()))
            .collect()
    }

    #[test]
    fn lock_files_name_the_directory_absolute_and_the_slot() {
        let r = Resource::parse("r".as_ref()).unwrap();
        let job = JobEnv {
            resources: vec![&r],
            step: "train",
            dir: Some(Path::new("locks")),
            slot: Some(2),
            fences: None,
            lock_key: None,
        };
        let here = std::env::current_dir().unwrap().join("locks");
        assert_eq!(
            vars(&job),
            [
                ("DEVLOCK_RESOURCES", "r"),
                ("DEVLOCK_DIR", here.to_str().unwrap()),
                ("DEVLOCK_STEP", "train"),
                ("DEVLOCK_SLOT", "2"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }

    #[test]
    fn etcd_names_its_fences_and_the_first_lock_as_etcdctl_does() {
        let (a, b) = (
            Resource::parse("a".as_ref()).unwrap(),
            Resource::parse("b".as_ref()).unwrap(),
        );
        let job = JobEnv {
            resources: vec![&a, &b],
            step: "s",
            dir: None,
            slot: None,
            fences: Some("7 9".into()),
            lock_key: Some(("/devlock/a/1".into(), Some(7))),
        };
        assert_eq!(
            vars(&job),
            [
                ("DEVLOCK_RESOURCES", "a b"),
                ("DEVLOCK_STEP", "s"),
                ("DEVLOCK_FENCE", "7 9"),
                ("ETCD_LOCK_KEY", "/devlock/a/1"),
                ("ETCD_LOCK_REV", "7"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }
}
