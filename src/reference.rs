//! f64 reference implementations (filled in by the reference work).
