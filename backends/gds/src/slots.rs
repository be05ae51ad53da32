//! A generational slot table: tokens are `generation << 32 | index`, so a token of a
//! removed entry never names a newer one. Capacity is reserved up front; a table grows
//! only past it (the backend checks `vacant` before inserting where it must not grow).

pub(crate) struct Slots<T> {
    entries: Vec<Option<T>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    len: usize,
    capacity: usize,
}

impl<T> Slots<T> {
    pub(crate) fn with_capacity(capacity: usize) -> Slots<T> {
        Slots {
            entries: Vec::with_capacity(capacity),
            generations: Vec::with_capacity(capacity),
            free: Vec::with_capacity(capacity),
            len: 0,
            capacity,
        }
    }

    /// Entries that fit before the reserved capacity is used up.
    pub(crate) fn vacant(&self) -> usize {
        self.capacity.saturating_sub(self.len)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn insert(&mut self, value: T) -> u64 {
        self.len += 1;
        let index = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = Some(value);
                i
            }
            None => {
                self.entries.push(Some(value));
                self.generations.push(0);
                (self.entries.len() - 1) as u32
            }
        };
        (u64::from(self.generations[index as usize]) << 32) | u64::from(index)
    }

    fn index(&self, token: u64) -> Option<usize> {
        let index = (token & u64::from(u32::MAX)) as usize;
        let generation = (token >> 32) as u32;
        match (self.entries.get(index), self.generations.get(index)) {
            (Some(Some(_)), Some(&g)) if g == generation => Some(index),
            _ => None,
        }
    }

    pub(crate) fn get(&self, token: u64) -> Option<&T> {
        self.index(token).and_then(|i| self.entries[i].as_ref())
    }

    pub(crate) fn get_mut(&mut self, token: u64) -> Option<&mut T> {
        self.index(token).and_then(|i| self.entries[i].as_mut())
    }

    pub(crate) fn remove(&mut self, token: u64) -> Option<T> {
        let i = self.index(token)?;
        let value = self.entries[i].take();
        self.generations[i] = self.generations[i].wrapping_add(1);
        self.free.push(i as u32);
        self.len -= 1;
        value
    }

    /// Remove every entry.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.len = 0;
        self.free.clear();
        for (i, g) in self.generations.iter_mut().enumerate() {
            *g = g.wrapping_add(1);
            self.free.push(i as u32);
        }
        self.entries.iter_mut().filter_map(Option::take)
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn stale_tokens_name_nothing() {
        let mut slots = Slots::with_capacity(2);
        let a = slots.insert("a");
        assert_eq!(slots.get(a), Some(&"a"));
        assert_eq!(slots.remove(a), Some("a"));
        let b = slots.insert("b");
        assert_ne!(a, b, "a reused slot has a new generation");
        assert_eq!(slots.get(a), None);
        assert_eq!(slots.get(b), Some(&"b"));
        assert_eq!(slots.vacant(), 1);
        assert_eq!(slots.drain().count(), 1);
        assert_eq!(slots.get(b), None);
        assert_eq!(slots.len(), 0);
    }
}
