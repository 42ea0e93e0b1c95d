"""Test tools that users and CI share (the network lab)."""
