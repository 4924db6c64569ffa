// A Java agent that does nothing. LocalStack starts DynamoDB Local with
// `-javaagent:<lib>/dynamodb-local/2/ddb-local-loader-0.1.jar` (its patch for more than 20 GSIs,
// which it would download); the JVM refuses to start without that jar, and LocalStack then
// restarts it in a loop. scripts/services/localstack.sh compiles this class and packs it, with a
// manifest naming it as the Premain-Class, into that jar: idem needs no part of the patch.
package idem.localstack;

public final class NoopAgent {
    private NoopAgent() {}

    /** Called by the JVM before `main`; does nothing. */
    public static void premain(String args, java.lang.instrument.Instrumentation inst) {}
}
