"""Thin Lightning callbacks over modelwright.measure."""
