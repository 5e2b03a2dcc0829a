"""Tests of the privacy package."""
