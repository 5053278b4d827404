"""Control: side channel, wire messages, leases (DESIGN §6)."""
