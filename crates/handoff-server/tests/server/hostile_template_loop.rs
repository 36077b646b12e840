//! Story: an operator is handed a model file whose chat template loops
//! 10^10 times. The server used to hang while loading it; now the template
//! runs out of its fuel on the loader's probe conversation, and the server
//! refuses to start within seconds: exit 2, with an error that names the
//! template and the fuel budget. The model with a sound template serves.

use crate::hostile_templates::{LOOP_1E10, refused, the_fixture_still_serves};

#[test]
fn a_template_looping_ten_billion_times_is_refused_at_load() {
    let (status, stderr, took) = refused(LOOP_1E10);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("chat template exceeded its fuel budget of"),
        "{stderr}"
    );
    assert!(stderr.contains("refused"), "{stderr}");
    assert!(took.as_secs() < 30, "refused after {took:?}");
    the_fixture_still_serves();
}
