"""Measurement of model quality: multiple-choice accuracy and perplexity (`anychip eval`)."""
