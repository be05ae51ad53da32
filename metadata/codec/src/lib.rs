//! Ferry's rkyv metadata wire format: encode, validate once, read in place.
