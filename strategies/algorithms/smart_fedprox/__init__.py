"""SmartFedProx: FedProx with divergence-aware hybrid client selection and adaptive mu."""
