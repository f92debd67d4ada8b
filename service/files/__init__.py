"""Files users send and jobs make: ``storage`` (a local directory or an S3-compatible bucket,
behind one ``Store`` interface: ``FileStore``, ``S3Store``), ``code`` (code bundles checked and
unpacked), ``codestore`` (where bundles live and each host's cache of them) and ``datasets``
(uploaded ``.npz`` files checked from their headers)."""
