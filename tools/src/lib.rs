//! The ferry command-line tool.
