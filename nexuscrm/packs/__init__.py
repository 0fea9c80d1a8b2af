"""Pack manifests, loaders (native YAML/JSON and Salesforce DX source), ordering, payload hash."""
