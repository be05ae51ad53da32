//! Ferry's built-in in-process DRAM backend (the embedded default and test vehicle).
