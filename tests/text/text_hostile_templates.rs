//! Story: a model file is a stranger's code. Its chat template is Jinja, and
//! a hostile one can loop 10^10 times, double a string until the process
//! dies, or behave on the probe conversations the loader renders and loop
//! on a real one. Every render runs under a fuel budget, an output cap and
//! a deadline ([`TemplateLimits`]): the first two templates are refused
//! when they are loaded, with a typed error naming the limit; the third
//! loads, and fails only the conversation it loops on, by its deadline at
//! the latest, while the same template still renders other conversations.

use std::time::{Duration, Instant};

use handoff::HttpStatus;
use handoff::text::{ChatTemplate, Message, TemplateLimit, TemplateLimits, TextError};

/// 10^10 iterations: minijinja caps one `range` at 100,000 items.
const LOOP_1E10: &str = "{% for i in range(100000) %}{% for j in range(100000) %}\
{% endfor %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}";

/// A string doubled 40 times: a terabyte, were it built.
const DOUBLING: &str = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}\
{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";

/// ChatML, unless a message is longer than the probes' (100 characters):
/// then 10^10 iterations.
const SLEEPER: &str = "{% for m in messages %}{% if m.content | length > 100 %}\
{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}\
<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn refused_at_load(source: &str, limits: TemplateLimits) -> TemplateLimit {
    let started = Instant::now();
    let err = ChatTemplate::with_limits(source, None, None, limits).unwrap_err();
    assert!(
        started.elapsed() < limits.deadline * 8 + Duration::from_secs(2),
        "refused in {:?}",
        started.elapsed()
    );
    let TextError::TemplateLimit { limit, at_load } = err else {
        panic!("not a limit: {err}");
    };
    assert!(at_load);
    let message = TextError::TemplateLimit { limit, at_load }.to_string();
    assert!(message.contains("refused"), "{message}");
    assert!(message.contains(&limit.to_string()), "{message}");
    limit
}

#[test]
fn a_ten_billion_iteration_loop_is_refused_at_load_for_its_fuel() {
    let limits = TemplateLimits::default();
    let limit = refused_at_load(LOOP_1E10, limits);
    assert_eq!(limit, TemplateLimit::Fuel(limits.fuel));
    assert!(limit.to_string().contains("fuel budget of 1000000"));
}

#[test]
fn a_string_doubling_to_a_terabyte_is_refused_at_load_before_it_is_built() {
    let limits = TemplateLimits::default();
    // Fuel pays for data too (one per 64 bytes): the string stops growing
    // near 64 MB, long before the process could die of it.
    assert_eq!(
        refused_at_load(DOUBLING, limits),
        TemplateLimit::Fuel(limits.fuel)
    );
}

#[test]
fn output_past_the_cap_and_a_render_past_the_deadline_are_refused_by_name() {
    // Cheap in fuel (about 140,000), 9 MB of text: over the 8 MiB cap.
    let big = "{{ 'x' * 9000000 }}";
    assert_eq!(
        refused_at_load(big, TemplateLimits::default()),
        TemplateLimit::OutputBytes(8 << 20)
    );
    // Plenty of fuel, little time: the deadline ends the wait, while the
    // abandoned render runs out of its (finite) fuel on its own.
    let slow = TemplateLimits {
        fuel: 30_000_000,
        deadline: Duration::from_millis(20),
        ..TemplateLimits::default()
    };
    assert_eq!(
        refused_at_load(LOOP_1E10, slow),
        TemplateLimit::Deadline(Duration::from_millis(20))
    );
}

#[test]
fn a_template_that_loops_only_on_real_conversations_fails_only_those() {
    let limits = TemplateLimits {
        deadline: Duration::from_millis(500),
        ..TemplateLimits::default()
    };
    let t = ChatTemplate::with_limits(SLEEPER, None, None, limits).expect("it behaves at load");
    let short = [Message::new("user", "Hi")];
    assert_eq!(
        t.render(&short, true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let long = [Message::new("user", "tell me a story ".repeat(10))];
    let started = Instant::now();
    let err = t.render(&long, true).unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(
            err,
            TextError::TemplateLimit {
                limit: TemplateLimit::Fuel(_) | TemplateLimit::Deadline(_),
                at_load: false
            }
        ),
        "{err}"
    );
    assert!(took <= Duration::from_secs(2), "failed after {took:?}");
    assert!(
        err.to_string().contains("rendering this conversation"),
        "{err}"
    );
    // The model's template is at fault, not the client: a server error.
    assert_eq!(err.http_status(), 500);
    // The template still serves the conversations it can.
    assert!(t.render(&short, true).is_ok());
}
