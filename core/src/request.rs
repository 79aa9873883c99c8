//! The ordered list of locks a command line asks for, which both backends
//! take: each resource, a member's group (and a MIG instance's GPU) taken
//! shared on its behalf, merged
//! and sorted into the one global lock order.

use crate::resource::Resource;

/// One lock to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub name: Resource,
    pub exclusive: bool,
    /// For a group taken shared on behalf of a member: the member.
    pub via: Option<Resource>,
    /// Semaphore size (`--slots`), 0 for a plain lock.
    pub slots: u64,
    /// A member taken exclusively because its whole group is (see
    /// `take::take_members`): held, but not what the command was given.
    pub for_group: bool,
}

impl Request {
    /// What lines call a request: its resource, or for a group taken
    /// shared on a member's behalf, the member and its group (what the user
    /// asked for, and what stands in the way). A name, not a sentence.
    pub(crate) fn label(&self) -> String {
        match &self.via {
            Some(member) => format!("{member} (its group {})", self.name),
            None => self.name.to_string(),
        }
    }
}

/// The locks `resources` stand for, in the one global order (sorted names):
/// each resource, and for a member `G:M` its group `G` shared on its behalf.
/// The etcd backend takes the same list.
pub(crate) fn in_order(resources: &[Resource], exclusive: bool, slots: u64) -> Vec<Request> {
    let mut requests = Vec::new();
    for resource in resources {
        for ancestor in resource.held_shared() {
            add(
                &mut requests,
                Request {
                    name: ancestor,
                    exclusive: false,
                    via: Some(resource.clone()),
                    slots: 0,
                    for_group: false,
                },
            );
        }
        add(
            &mut requests,
            Request {
                name: resource.clone(),
                exclusive,
                via: None,
                slots,
                for_group: false,
            },
        );
    }
    requests.sort_by(|a, b| a.name.cmp(&b.name));
    requests
}

/// Adds a request, merging it with one for the same lock (exclusive wins).
fn add(requests: &mut Vec<Request>, request: Request) {
    match requests.iter_mut().find(|r| r.name == request.name) {
        Some(existing) => {
            existing.exclusive |= request.exclusive;
            if request.via.is_none() {
                existing.via = None;
                existing.slots = request.slots;
            }
        }
        None => requests.push(request),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_bring_their_group_in_order() {
        let names = |v: &[&str]| {
            let rs: Vec<Resource> = v
                .iter()
                .map(|n| Resource::parse(n.as_ref()).unwrap())
                .collect();
            in_order(&rs, true, 0)
                .into_iter()
                .map(|r| format!("{}{}", r.name.as_str(), if r.exclusive { "!" } else { "" }))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&["zz", "gpu:1"]), ["gpu", "gpu:1!", "zz!"]);
        assert_eq!(names(&["gpu:1", "gpu"]), ["gpu!", "gpu:1!"]);
        assert_eq!(
            names(&["gpu:1:1g.18gb:gi9.ci0", "gpu:1:1g.18gb:gi10.ci0"]),
            [
                "gpu",
                "gpu:1",
                "gpu:1:1g.18gb:gi10.ci0!",
                "gpu:1:1g.18gb:gi9.ci0!"
            ]
        );
        assert_eq!(
            names(&["gpu:1:1g.18gb:gi9.ci0", "gpu:1"]),
            ["gpu", "gpu:1!", "gpu:1:1g.18gb:gi9.ci0!"]
        );
    }
}
