"""Communication primitives: bit packing, voting on packed words, and messages that know their size."""
