"""Cache tiers: RAM (next-use ordered), SSD (cache-once, persistent), and the tiered lookup."""
