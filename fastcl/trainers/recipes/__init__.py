"""The methods: SimCSE (unsup, sup), SupMPN, SupCon + CE (Liao), EdaCSE. See docs/training.md."""
