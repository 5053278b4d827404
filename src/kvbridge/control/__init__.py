"""Control: side channel, wire messages, leases (map: ``docs/structure.md``)."""
