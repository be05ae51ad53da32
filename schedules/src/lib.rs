//! Ferry's command buffer and phased executor.
